"""Every engine and server knob as one named setting: a flag, an env var and a config-file key.

Precedence: flag > env var `PAGEDSERVE_<NAME>` > config file (flat TOML, `--config` or
`PAGEDSERVE_CONFIG`) > default. The SETTINGS table below is the only list of settings: the
flags, the env and file parsing and docs/CONFIG.md all come from it, and each setting's type
and default are read from the config dataclass field it sets, so none of them can drift.
A config mistake is a ConfigError: one line that names the setting and where its value came from.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, get_args, get_type_hints

from engine.config import (
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    QUANTIZATIONS,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    engine_config_from_flat,
)
from engine.errors import ValidationError
from engine.text.tool_use import TOOL_FORMATS
from service.config import ServerConfig
from service.tracing import TRACE_EXPORTERS

if sys.version_info >= (3, 11):
    import tomllib
else:  # the backport, a dependency only on 3.10
    import tomli as tomllib

ENV_PREFIX = "PAGEDSERVE_"
CONFIG_ENV = "PAGEDSERVE_CONFIG"
_TRUE = ("true", "1", "yes")
_FALSE = ("false", "0", "no")


class ConfigError(Exception):
    """An invalid setting; the message is one line that says where the bad value came from."""


@dataclass(frozen=True)
class Setting:
    name: str  # the config-file key; the env var and (unless `flag` says otherwise) the flag
    section: str  # engine | server | log: which config the setting feeds
    kind: type  # str | int | float | bool
    default: Any  # None: unset, the help says what that means
    help: str
    flag: str  # without the leading dashes; booleans also get --no-<flag>
    choices: tuple[str, ...] = ()  # matched case-insensitively, stored as written here

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def flags(self) -> str:
        return f"--{self.flag} / --no-{self.flag}" if self.kind is bool else f"--{self.flag}"

    def from_text(self, raw: str) -> Any:
        """A value from a flag or an env var; ValueError(message) if it is not one."""
        if self.kind is bool:
            if raw.lower() in _TRUE + _FALSE:
                return raw.lower() in _TRUE
            raise ValueError(f"expected true/false/1/0/yes/no, got {raw!r}")
        if self.kind is int:
            try:
                return int(raw)
            except ValueError:
                raise ValueError(f"expected an integer, got {raw!r}") from None
        if self.kind is float:
            try:
                return float(raw)
            except ValueError:
                raise ValueError(f"expected a number, got {raw!r}") from None
        return self._choose(raw)

    def from_toml(self, value: object) -> Any:
        """A value from the config file, whose TOML types must match (an int for a float is fine)."""
        is_bool = isinstance(value, bool)  # a bool is also an int in Python
        if self.kind is bool and not is_bool:
            raise ValueError(f"expected true or false, got {value!r}")
        if self.kind is int and (is_bool or not isinstance(value, int)):
            raise ValueError(f"expected an integer, got {value!r}")
        if self.kind is float:
            if is_bool or not isinstance(value, int | float):
                raise ValueError(f"expected a number, got {value!r}")
            return float(value)
        if self.kind is str:
            if not isinstance(value, str):
                raise ValueError(f"expected a string, got {value!r}")
            return self._choose(value)
        return value

    def _choose(self, value: str) -> str:
        if not self.choices:
            return value
        for choice in self.choices:
            if value.lower() == choice.lower():
                return choice
        raise ValueError(f"expected one of {', '.join(self.choices)}, got {value!r}")


_SECTION_CLASSES: dict[str, tuple[type, ...]] = {
    "engine": (EngineConfig, CacheConfig, SchedulerConfig),
    "server": (ServerConfig,),
}


def _setting(
    section: str,
    name: str,
    help: str,
    *,
    flag: str | None = None,
    choices: tuple[str, ...] = (),
) -> Setting:
    """A setting whose type and default are those of the dataclass field of its name."""
    cls = next(c for c in _SECTION_CLASSES[section] if name in {f.name for f in fields(c)})
    hint = get_type_hints(cls)[name]
    kind = next(a for a in get_args(hint) if a is not types.NoneType) if get_args(hint) else hint
    default = cls.__dataclass_fields__[name].default
    return Setting(name, section, kind, default, help, flag or name.replace("_", "-"), choices)


SETTINGS: tuple[Setting, ...] = (
    _setting(
        "engine",
        "model",
        "HF model dir, .gguf file, Hugging Face repo id (org/name[@revision], fetched into the "
        "hub cache unless there; a local path of the same spelling wins) or alias; unset: the "
        "embedded default",
    ),
    _setting(
        "engine",
        "revision",
        "a repo id's branch, tag or commit (the same as org/name@revision; given both ways, "
        "they must agree); unset: the repo's default branch",
    ),
    _setting(
        "engine",
        "download_dir",
        "the Hugging Face hub cache repo ids are fetched into and looked up in; unset: "
        "huggingface_hub's own (HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub)",
    ),
    _setting("engine", "device", "auto, cpu or cuda[:N]"),
    _setting(
        "engine",
        "dtype",
        "auto (cpu: float32, cuda: bfloat16), float32 (cpu only), bfloat16, float16",
    ),
    _setting(
        "engine",
        "load_format",
        "auto: the checkpoint's weights; dummy: random weights of the config's shapes, no "
        "weights read (benchmarks)",
        choices=LOAD_FORMATS,
    ),
    _setting(
        "engine",
        "quantization",
        "fp8: quantize the checkpoint's projections to fp8 as they load (per output row; "
        "activations per token, but for decode batches of 1-2 rows, which stay 16-bit), CUDA "
        "of compute capability 8.9 or newer only; unset: the "
        "checkpoint's own weights (an fp8 checkpoint runs in fp8 where it can, dequantized "
        "elsewhere)",
        choices=QUANTIZATIONS,
    ),
    _setting("engine", "max_model_len", "context length cap; unset: the model's own"),
    _setting("engine", "engine_seed", "seeds the draws of requests that bring no seed"),
    _setting("engine", "enforce_eager", "CUDA: run every step eagerly, no CUDA graphs"),
    _setting(
        "engine",
        "grammar_compile_timeout",
        "structured output: seconds a constraint's grammar (JSON schema, regex, grammar) may "
        "take to build before the request is refused, and may wait for a compile thread "
        "before it is told to retry",
    ),
    _setting(
        "engine",
        "grammar_step_timeout",
        "structured output: seconds of CPU time a constraint's work for one token (its "
        "token mask, or moving past a token) may take before the request fails, naming the "
        "constraint; every row of a step waits for the slowest mask",
    ),
    _setting(
        "engine",
        "grammar_fast_forward",
        "structured output: append the tokens a grammar forces without a step each (the "
        "next step computes them in one chunk); off: every token takes a step",
    ),
    _setting(
        "engine",
        "kernel_cache_dir",
        "where Triton (<dir>/triton) and flashinfer (<dir>/.cache/flashinfer) keep the "
        "kernels they build; fill it with `pagedserve warmup` and serve with the same "
        "settings, so no start compiles. Unset: their defaults under the home directory",
    ),
    _setting(
        "engine",
        "tensor_parallel_size",
        "split the model over this many ranks, a process and a GPU each (consecutive GPUs "
        "from the device's index; gloo processes on the CPU)",
    ),
    _setting(
        "engine",
        "tensor_parallel_timeout",
        "seconds a tensor-parallel collective may wait for a rank before the engine fails "
        "(and the server exits)",
    ),
    _setting(
        "engine",
        "async_scheduling",
        "queue the next step before reading this one's tokens back; unset: on for CUDA only",
    ),
    _setting(
        "engine",
        "block_size",
        "tokens per KV block (a power of two up to 128); unset: 64 on CUDA, 16 on the CPU",
    ),
    _setting("engine", "num_blocks", "KV blocks; unset: sized from memory"),
    _setting("engine", "kv_cache_memory_gib", "KV pool size on the CPU when num_blocks is unset"),
    _setting(
        "engine",
        "kv_cache_dtype",
        "what the KV pool holds: auto (the model's dtype), bfloat16, float16, or fp8_e4m3 "
        "(twice the tokens; CUDA needs sm89 or later)",
        choices=KV_CACHE_DTYPES,
    ),
    _setting(
        "engine",
        "gpu_memory_utilization",
        "share of the GPU's memory to use, KV pool included, when num_blocks is unset (CUDA)",
    ),
    _setting(
        "engine",
        "enable_prefix_caching",
        "share the KV blocks of equal prompt prefixes",
        flag="prefix-caching",
    ),
    _setting("engine", "max_num_seqs", "running sequences (candidates) at once"),
    _setting("engine", "max_num_batched_tokens", "tokens per step, prefill and decode together"),
    _setting(
        "engine",
        "enable_chunked_prefill",
        "split long prompts over several steps",
        flag="chunked-prefill",
    ),
    _setting(
        "engine",
        "target_step_seconds",
        "cut each step's prefill to what a step of this many seconds holds at the rate "
        "recent steps ran (never below its decodes and 64 prompt tokens): a leaving "
        "caller and every stream's next token wait for the step running. Needs chunked "
        "prefill; unset: 0.25 on the CPU, untimed on CUDA; 0: untimed",
    ),
    _setting(
        "server",
        "host",
        "address the gRPC server binds, and REST and /metrics unless their own is set "
        "(0.0.0.0: every interface)",
    ),
    _setting("server", "grpc_port", "gRPC port (0: any free port)"),
    _setting(
        "server", "max_message_bytes", "largest gRPC message, either way, and REST body (413)"
    ),
    _setting("server", "max_queued_requests", "the engine's bounded request queue"),
    _setting(
        "server", "mailbox_size", "events a candidate may have unread before its stream fails"
    ),
    _setting(
        "server",
        "engine_process",
        "run the engine loop in a child process; unset: on for CUDA only",
    ),
    _setting("server", "drain_seconds", "grace for in-flight requests after SIGTERM"),
    _setting(
        "server",
        "engine_stall_seconds",
        "engine watchdog: work waiting and no step finished for this long turns liveness and "
        "readiness NOT_SERVING until the loop steps again (a dead loop ends the process, exit "
        "1); keep it above the longest step",
    ),
    _setting(
        "server",
        "metrics_host",
        "address the Prometheus /metrics endpoint binds; unset: host's",
    ),
    _setting("server", "metrics_port", "Prometheus /metrics port; unset: no metrics endpoint"),
    _setting("server", "trace_exporter", "OpenTelemetry spans", choices=TRACE_EXPORTERS),
    _setting("server", "otlp_endpoint", "e.g. http://collector:4317 (trace_exporter otlp only)"),
    _setting(
        "server",
        "kv_events_endpoint",
        "publish the prefix cache's KV events over ZMQ for a cache-aware router: tcp://*:5557 "
        "binds, tcp://host:5557 connects; unset: not published (the gRPC gateway door "
        "streams them either way)",
    ),
    _setting(
        "server",
        "kv_events_topic",
        "the KV events' ZMQ topic; unset: kv@<host name>@<served model name> (llm-d's "
        "picker wants kv@<pod IP>:<port>@<model>)",
    ),
    _setting("server", "http_host", "address the OpenAI-compatible REST shim binds; unset: host's"),
    _setting(
        "server",
        "http_port",
        "OpenAI-compatible REST port (/v1/completions, /v1/chat/completions, ...); unset: no REST",
    ),
    _setting(
        "server",
        "http_read_timeout",
        "seconds a REST client has to send a request's headers, and again its body; one "
        "slower is cut off (a body: 408). The rest of a body refused unread (401, 413) has "
        "as long before the connection closes",
    ),
    _setting(
        "server",
        "api_key",
        "callers must send Authorization: Bearer <key> (REST header, gRPC metadata; health "
        "and reflection stay open); unset: no key. Prefer the env var to the flag",
    ),
    _setting(
        "server",
        "tls_cert_file",
        "PEM certificate (chain) for TLS on the gRPC port and the REST shim; with "
        "tls_key_file. Unset: plaintext",
    ),
    _setting("server", "tls_key_file", "PEM private key of tls_cert_file (unencrypted)"),
    _setting(
        "server",
        "tls_client_ca_file",
        "PEM CA bundle: with it (mTLS) callers of both ports must present a client "
        "certificate signed by it; request ids are then scoped per certificate. Unset: none asked",
    ),
    _setting(
        "server",
        "health_port",
        "a plaintext gRPC port serving only the health service, for probes that cannot do "
        "TLS (Kubernetes' grpc probe); unset: health only on grpc_port",
    ),
    _setting(
        "server",
        "log_requests",
        "log every request's prompt and output (logger service.requests, at INFO whatever "
        "log_level); off: request content never reaches the log, at any level",
    ),
    _setting(
        "server",
        "tool_parser",
        "the format the model writes tool calls in; auto: read off its chat template "
        "(llama3_json where it speaks of <|python_tag|>, else hermes)",
        choices=("auto", *TOOL_FORMATS),
    ),
    # Logging configures the process itself, so it has no config dataclass.
    Setting(
        "log_level",
        "log",
        str,
        "WARNING",
        "log threshold",
        "log-level",
        ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
    ),
)
BY_NAME = {s.name: s for s in SETTINGS}


def toml_literal(value: Any) -> str:
    """How a value is written in the config file (None: unset, which TOML cannot write)."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    return json.dumps(value) if isinstance(value, str) else str(value)  # a JSON string is TOML


def add_setting_flags(
    parser: argparse.ArgumentParser, section: str, only: tuple[str, ...] | None = None
) -> None:
    """One flag per setting of `section` (those named in `only`, if given); a flag not given
    leaves no attribute (SUPPRESS)."""
    group = parser.add_argument_group(section)
    for s in SETTINGS:
        if s.section != section or (only is not None and s.name not in only):
            continue
        help = f"{s.help} (default {toml_literal(s.default)}; env {s.env})"
        if s.kind is bool:
            group.add_argument(
                f"--{s.flag}",
                dest=s.name,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=help,
            )
        else:
            group.add_argument(
                f"--{s.flag}",
                dest=s.name,
                type=_flag_type(s),
                default=argparse.SUPPRESS,
                metavar="{" + ",".join(s.choices) + "}" if s.choices else None,
                help=help,
            )


def _flag_type(setting: Setting) -> Callable[[str], Any]:
    def convert(raw: str) -> Any:
        try:
            return setting.from_text(raw)
        except ValueError as exc:  # argparse shows only an ArgumentTypeError's own message
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


@dataclass(frozen=True)
class Settings:
    """The values set somewhere (flag, env or file) and, for each, where it came from."""

    values: dict[str, Any]
    sources: dict[str, str]  # name -> e.g. "env PAGEDSERVE_GRPC_PORT"

    def get(self, name: str) -> Any:
        return self.values.get(name, BY_NAME[name].default)

    def engine_config(self) -> EngineConfig:
        flat = self._section_values("engine")
        return self._build("engine", lambda: engine_config_from_flat(**flat))

    def server_config(self) -> ServerConfig:
        values = self._section_values("server")
        return self._build("server", lambda: ServerConfig(**values))

    def _section_values(self, section: str) -> dict[str, Any]:
        return {
            s.name: self.values[s.name]
            for s in SETTINGS
            if s.section == section and s.name in self.values
        }

    def _build(self, section: str, make: Callable[[], Any]) -> Any:
        """Run the dataclasses' own validation; name the bad value's source if it fails."""
        try:
            return make()
        except ValidationError as exc:
            setting = BY_NAME.get(exc.field)
            if setting is None:  # a field with no setting of its own: say what we know
                raise ConfigError(f"{section} config: {exc}") from None
            message = str(exc).removeprefix(f"{exc.field}: ")
            where = self.sources.get(setting.name, setting.name)  # a default: just its name
            raise ConfigError(f"{where}: {message}") from None
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{section} config: {exc}") from None


def resolve_settings(args: argparse.Namespace, environ: Mapping[str, str]) -> Settings:
    """Merge the config file, then env vars, then flags over it; ConfigError on a bad value."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    path = getattr(args, "config", None) or environ.get(CONFIG_ENV)
    if path:
        for name, value in read_config_file(path).items():
            values[name], sources[name] = value, f"config file {path}: {name}"
    for s in SETTINGS:
        raw = environ.get(s.env)
        if raw:  # an empty variable counts as unset, as k8s templating often leaves them
            where = f"env {s.env}"
            values[s.name], sources[s.name] = _parsed(s.from_text, raw, where), where
    for s in SETTINGS:
        if s.name in vars(args):
            values[s.name], sources[s.name] = getattr(args, s.name), f"argument --{s.flag}"
    return Settings(values, sources)


def read_config_file(path: str) -> dict[str, Any]:
    """The settings of a flat TOML file; unknown keys are an error, so a typo is never ignored."""
    where = f"config file {path}"
    try:
        with open(path, "rb") as f:
            document = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"{where}: {exc.strerror or exc}") from None
    except ValueError as exc:  # TOMLDecodeError, or bytes that are not UTF-8
        raise ConfigError(f"{where}: invalid TOML: {exc}") from None
    values = {}
    for key, value in document.items():
        setting = BY_NAME.get(key)
        if setting is None:
            close = difflib.get_close_matches(key, BY_NAME, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            if isinstance(value, dict):
                hint = " (settings are top-level keys; the file has no tables)"
            raise ConfigError(f"{where}: unknown setting {key!r}{hint}")
        values[key] = _parsed(setting.from_toml, value, f"{where}: {key}")
    return values


def _parsed(parse: Callable[[Any], Any], value: Any, where: str) -> Any:
    try:
        return parse(value)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def markdown_tables() -> str:
    """The settings reference in docs/CONFIG.md (regenerate: python -m service.settings)."""
    lines = []
    for section in dict.fromkeys(s.section for s in SETTINGS):
        lines += [
            f"### {section}",
            "",
            "| setting | flag | env var | default | meaning |",
            "|---|---|---|---|---|",
        ]
        for s in SETTINGS:
            if s.section == section:
                choices = f" (one of {', '.join(s.choices)})" if s.choices else ""
                default = "unset" if s.default is None else f"`{toml_literal(s.default)}`"
                lines.append(
                    f"| `{s.name}` | `{s.flags}` | `{s.env}` | {default} | {s.help}{choices} |"
                )
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_tables(), end="")
