"""Settings from flags, env vars and a config file: precedence, parsing, one-line errors."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from service.cli import build_parser, main
from service.config import ServerConfig
from service.settings import (
    CONFIG_ENV,
    SETTINGS,
    Setting,
    Settings,
    markdown_tables,
    resolve_settings,
    toml_literal,
)
from tests.tls_certs import Pki, write_pki

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No PAGEDSERVE_* setting leaks in from the machine running the tests."""
    for s in SETTINGS:
        monkeypatch.delenv(s.env, raising=False)
    monkeypatch.delenv(CONFIG_ENV, raising=False)


@pytest.fixture(autouse=True)
def never_serve(monkeypatch):
    """A config these tests think invalid must never get as far as serving."""

    def fail(*args, **kwargs):
        raise AssertionError("serve() was called: the config was accepted")

    monkeypatch.setattr("service.serve.serve", fail)


def resolve(argv: list[str], env: dict[str, str] | None = None) -> Settings:
    return resolve_settings(build_parser().parse_args(["serve", *argv]), env or {})


def write(tmp_path: Path, text: str, name: str = "k8s.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def run_main(argv: list[str], capsys) -> tuple[int, list[str]]:
    """main()'s exit code (argparse's own errors exit) and its stderr lines."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    assert captured.out == ""
    return code, captured.err.splitlines()


# --- precedence: flag > env > file > default ---------------------------------------------


@pytest.mark.parametrize(
    ("layers", "seqs", "port"),
    [
        ((), 256, 50051),
        (("file",), 11, 1111),
        (("file", "env"), 22, 2222),
        (("file", "env", "flag"), 33, 3333),
        (("env", "flag"), 33, 3333),
        (("file", "flag"), 33, 3333),
    ],
)
def test_precedence_flag_env_file_default(tmp_path, layers, seqs, port):
    argv: list[str] = []
    env: dict[str, str] = {}
    if "file" in layers:
        argv += ["--config", write(tmp_path, "max_num_seqs = 11\ngrpc_port = 1111\n")]
    if "env" in layers:
        env |= {"PAGEDSERVE_MAX_NUM_SEQS": "22", "PAGEDSERVE_GRPC_PORT": "2222"}
    if "flag" in layers:
        argv += ["--max-num-seqs", "33", "--grpc-port", "3333"]
    settings = resolve(argv, env)
    assert settings.engine_config().scheduler.max_num_seqs == seqs
    assert settings.server_config().grpc_port == port


def test_config_file_path_from_env(tmp_path):
    env = {CONFIG_ENV: write(tmp_path, "drain_seconds = 5\nblock_size = 32\n")}
    settings = resolve([], env)
    assert settings.server_config().drain_seconds == 5.0
    assert settings.engine_config().cache.block_size == 32


def test_config_flag_beats_config_env(tmp_path):
    env = {CONFIG_ENV: write(tmp_path, "mailbox_size = 1\n", "env.toml")}
    settings = resolve(["--config", write(tmp_path, "mailbox_size = 2\n", "flag.toml")], env)
    assert settings.server_config().mailbox_size == 2


def test_empty_env_var_counts_as_unset(tmp_path):
    path = write(tmp_path, "max_queued_requests = 7\n")
    settings = resolve(["--config", path], {"PAGEDSERVE_MAX_QUEUED_REQUESTS": ""})
    assert settings.server_config().max_queued_requests == 7


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("false", False), ("FALSE", False), ("0", False), ("no", False), ("No", False)]
    + [("true", True), ("True", True), ("1", True), ("yes", True), ("YES", True)],
)
def test_bool_env_values(raw, expected):
    settings = resolve([], {"PAGEDSERVE_ENABLE_PREFIX_CACHING": raw})
    assert settings.engine_config().cache.enable_prefix_caching is expected


def test_bool_flags_beat_env_both_ways():
    on = resolve(["--prefix-caching"], {"PAGEDSERVE_ENABLE_PREFIX_CACHING": "no"})
    off = resolve(["--no-chunked-prefill"], {"PAGEDSERVE_ENABLE_CHUNKED_PREFILL": "yes"})
    assert on.engine_config().cache.enable_prefix_caching is True
    assert off.engine_config().scheduler.enable_chunked_prefill is False


def test_choices_match_in_any_case():
    settings = resolve(["--log-level", "debug"], {"PAGEDSERVE_TRACE_EXPORTER": "OTLP"})
    assert settings.get("log_level") == "DEBUG"
    assert settings.server_config().trace_exporter == "otlp"


def test_top_level_log_level_survives_the_subcommand():
    args = build_parser().parse_args(["--log-level", "error", "serve"])
    assert resolve_settings(args, {}).get("log_level") == "ERROR"


# --- every setting, every way -------------------------------------------------------------

# A valid value unlike the default, for each setting; a new setting must add one here.
SAMPLES = {
    "model": "/models/m",
    "revision": "v2",
    "load_format": "dummy",
    "quantization": "fp8",
    "download_dir": "/var/cache/huggingface/hub",
    "device": "cpu",
    "dtype": "float16",
    "max_model_len": 77,
    "tensor_parallel_size": 3,
    "tensor_parallel_timeout": 45.0,
    "engine_seed": 5,
    "enforce_eager": True,
    "grammar_compile_timeout": 2.5,
    "grammar_step_timeout": 0.25,
    "grammar_fast_forward": False,
    "kernel_cache_dir": "/var/cache/pagedserve/kernels",
    "async_scheduling": True,
    "block_size": 32,
    "num_blocks": 9,
    "kv_cache_memory_gib": 2.5,
    "kv_cache_dtype": "fp8_e4m3",
    "gpu_memory_utilization": 0.5,
    "enable_prefix_caching": False,
    "max_num_seqs": 3,
    "max_num_batched_tokens": 99,
    "enable_chunked_prefill": False,
    "target_step_seconds": 0.5,
    "host": "0.0.0.0",
    "grpc_port": 6000,
    "max_message_bytes": 1000,
    "max_queued_requests": 4,
    "mailbox_size": 8,
    "engine_process": True,
    "drain_seconds": 1.5,
    "engine_stall_seconds": 7.5,
    "http_read_timeout": 12.5,
    "metrics_host": "127.0.0.1",
    "metrics_port": 9090,
    "trace_exporter": "console",
    "otlp_endpoint": "http://collector:4317",
    "kv_events_endpoint": "tcp://*:5557",
    "kv_events_topic": "kv@10.0.0.7:8000@smollm2",
    "http_host": "0.0.0.0",
    "http_port": 8000,
    "api_key": "s3cret",
    "tls_cert_file": "<pki>",  # real files, from the pki fixture: see tls_sample()
    "tls_key_file": "<pki>",
    "tls_client_ca_file": "<pki>",
    "health_port": 50052,
    "log_requests": True,
    "tool_parser": "llama3_json",
    "log_level": "INFO",
}


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return write_pki(tmp_path_factory.mktemp("pki"))


def tls_sample(pki: Pki, name: str) -> tuple[str, dict[str, str]]:
    """A TLS file setting's sample value and the settings it needs beside it (as env vars)."""
    files = {
        "tls_cert_file": str(pki.server_cert),
        "tls_key_file": str(pki.server_key),
        "tls_client_ca_file": str(pki.ca),
    }
    needs = {"tls_cert_file", "tls_key_file"} - {name}
    return files[name], {f"PAGEDSERVE_{n.upper()}": files[n] for n in needs}


def configured(settings: Settings, s: Setting) -> object:
    """The value a setting ends up with in the config it feeds."""
    if s.section == "server":
        return getattr(settings.server_config(), s.name)
    if s.section == "engine":
        engine = settings.engine_config()
        for part in (engine, engine.cache, engine.scheduler):
            if hasattr(part, s.name):
                return getattr(part, s.name)
    return settings.get(s.name)


def test_samples_cover_every_setting():
    assert set(SAMPLES) == {s.name for s in SETTINGS}
    assert all(SAMPLES[s.name] != s.default for s in SETTINGS)


@pytest.mark.parametrize("s", SETTINGS, ids=lambda s: s.name)
@pytest.mark.parametrize("way", ["flag", "env", "file"])
def test_every_setting_is_settable_every_way(tmp_path, pki, s, way):
    value, env = SAMPLES[s.name], {}
    if value == "<pki>":
        value, env = tls_sample(pki, s.name)
    text = str(value).lower() if isinstance(value, bool) else str(value)
    if way == "flag" and s.kind is bool:
        settings = resolve([f"--{'' if value else 'no-'}{s.flag}"], env)
    elif way == "flag":
        settings = resolve([f"--{s.flag}", text], env)
    elif way == "env":
        settings = resolve([], {**env, s.env: text})
    else:
        config = write(tmp_path, f"{s.name} = {toml_literal(value)}\n")
        settings = resolve(["--config", config], env)
    assert configured(settings, s) == value


def test_the_table_covers_every_config_field():
    """A new field in a config dataclass needs a setting, or it cannot be set at all."""
    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"cache", "scheduler"}
    expected = (
        {("engine", f) for f in engine_fields}
        | {("engine", f.name) for f in dataclasses.fields(CacheConfig)}
        | {("engine", f.name) for f in dataclasses.fields(SchedulerConfig)}
        | {("server", f.name) for f in dataclasses.fields(ServerConfig)}
        | {("log", "log_level")}
    )
    pairs = [(s.section, s.name) for s in SETTINGS]
    assert len(pairs) == len(set(pairs))
    assert set(pairs) == expected


def test_config_doc_lists_every_setting():
    doc = (REPO / "docs" / "CONFIG.md").read_text()
    assert markdown_tables() in doc, "docs/CONFIG.md is stale: python -m service.settings"
    for s in SETTINGS:
        assert f"| `{s.name}` | `{s.flags}` | `{s.env}` |" in doc


# --- invalid config: exit 2, one line naming the source and the setting ---------------------


def test_config_file_value_invalid(tmp_path, capsys):
    path = write(tmp_path, "max_num_seqs = 0\n")
    assert run_main(["serve", "--config", path], capsys) == (
        2,
        [f"pagedserve: error: config file {path}: max_num_seqs: must be >= 1, got 0"],
    )


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("grpc_port = 'abc'", "grpc_port: expected an integer, got 'abc'"),
        ("max_num_seqs = true", "max_num_seqs: expected an integer, got True"),
        ("max_num_seqs = 1.5", "max_num_seqs: expected an integer, got 1.5"),
        ("drain_seconds = '3'", "drain_seconds: expected a number, got '3'"),
        (
            "enable_prefix_caching = 'false'",
            "enable_prefix_caching: expected true or false, got 'false'",
        ),
        ("host = 1", "host: expected a string, got 1"),
        (
            "trace_exporter = 'jaeger'",
            "trace_exporter: expected one of none, console, otlp, got 'jaeger'",
        ),
        (
            "dtype = 'int8'",
            "dtype: must be auto or one of ['bfloat16', 'float16', 'float32'], got 'int8'",
        ),
        ("block_size = 3", "block_size: must be a power of two in [1, 128], got 3"),
        ("max_num_seq = 64", "unknown setting 'max_num_seq' (did you mean 'max_num_seqs'?)"),
        ("zzz = 1", "unknown setting 'zzz'"),
        (
            "[engine]\nmax_num_seqs = 64",
            "unknown setting 'engine' (settings are top-level keys; the file has no tables)",
        ),
    ],
)
def test_config_file_mistakes(tmp_path, capsys, toml, message):
    path = write(tmp_path, toml + "\n")
    code, err = run_main(["serve", "--config", path], capsys)
    assert (code, err) == (2, [f"pagedserve: error: config file {path}: {message}"])


def test_config_file_missing_or_not_toml(tmp_path, capsys):
    missing = str(tmp_path / "nope.toml")
    assert run_main(["serve", "--config", missing], capsys) == (
        2,
        [f"pagedserve: error: config file {missing}: No such file or directory"],
    )
    for name, content in [("broken.toml", b"max_num_seqs = \n"), ("bin.toml", b"\xff\xfe = 1\n")]:
        path = tmp_path / name
        path.write_bytes(content)
        code, err = run_main(["serve", "--config", str(path)], capsys)
        assert code == 2 and len(err) == 1
        assert err[0].startswith(f"pagedserve: error: config file {path}: invalid TOML: ")


@pytest.mark.parametrize(
    ("name", "raw", "message"),
    [
        ("PAGEDSERVE_GRPC_PORT", "abc", "expected an integer, got 'abc'"),
        ("PAGEDSERVE_MAX_NUM_SEQS", "0", "must be >= 1, got 0"),
        ("PAGEDSERVE_KV_CACHE_MEMORY_GIB", "lots", "expected a number, got 'lots'"),
        ("PAGEDSERVE_KV_CACHE_MEMORY_GIB", "-1", "must be > 0, got -1.0"),
        (
            "PAGEDSERVE_ENABLE_PREFIX_CACHING",
            "maybe",
            "expected true/false/1/0/yes/no, got 'maybe'",
        ),
        ("PAGEDSERVE_DEVICE", "tpu", "must be auto, cpu or cuda[:N], got 'tpu'"),
        (
            "PAGEDSERVE_LOG_LEVEL",
            "loud",
            "expected one of DEBUG, INFO, WARNING, ERROR, CRITICAL, got 'loud'",
        ),
    ],
)
def test_env_mistakes(monkeypatch, capsys, name, raw, message):
    monkeypatch.setenv(name, raw)
    assert run_main(["serve"], capsys) == (2, [f"pagedserve: error: env {name}: {message}"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--grpc-port", "abc"], "argument --grpc-port: expected an integer, got 'abc'"),
        (["--max-num-seqs", "0"], "argument --max-num-seqs: must be >= 1, got 0"),
        (["--engine-seed", "x"], "argument --engine-seed: expected an integer, got 'x'"),
        (
            ["--trace-exporter", "jaeger"],
            "argument --trace-exporter: expected one of none, console, otlp, got 'jaeger'",
        ),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (
            ["--model", "org/name@v1", "--revision", "v2"],
            "argument --revision: 'v2' disagrees with the model's own @v1 ('org/name@v1'); "
            "give it once",
        ),
        (["--model", "org/name@"], "argument --model: 'org/name@' has an empty revision after '@'"),
        (["--download-dir", " "], "argument --download-dir: must not be empty"),
    ],
)
def test_flag_mistakes(capsys, argv, message):
    assert run_main(["serve", *argv], capsys) == (2, [f"pagedserve: error: {message}"])


def test_bad_config_env_names_the_file(tmp_path, monkeypatch, capsys):
    path = write(tmp_path, "mailbox_size = 'big'\n")
    monkeypatch.setenv(CONFIG_ENV, path)
    assert run_main(["serve"], capsys) == (
        2,
        [f"pagedserve: error: config file {path}: mailbox_size: expected an integer, got 'big'"],
    )


def test_generate_reads_env_and_rejects_bad_values_before_loading(monkeypatch, capsys):
    monkeypatch.setenv("PAGEDSERVE_BLOCK_SIZE", "3")
    # The model does not exist: reaching the loader would be a different error.
    code, err = run_main(["generate", "--model", "/no/such/model", "--prompt", "x"], capsys)
    assert (code, err) == (
        2,
        ["pagedserve: error: env PAGEDSERVE_BLOCK_SIZE: must be a power of two in [1, 128], got 3"],
    )


# --- ServerConfig's own validation is reported the same way --------------------------------


@pytest.mark.parametrize(
    ("argv", "env", "line"),
    [
        (
            [],
            {"PAGEDSERVE_GRPC_PORT": "70000"},
            "env PAGEDSERVE_GRPC_PORT: must be a port in [0, 65535], got 70000",
        ),
        (["--grpc-port", "-1"], {}, "argument --grpc-port: must be a port in [0, 65535], got -1"),
        (["--mailbox-size", "0"], {}, "argument --mailbox-size: must be >= 1, got 0"),
        (
            [],
            {"PAGEDSERVE_DRAIN_SECONDS": "inf"},
            "env PAGEDSERVE_DRAIN_SECONDS: must be a finite number >= 0, got inf",
        ),
        (
            ["--max-message-bytes", "0"],
            {},
            "argument --max-message-bytes: must be in [1, 2**31 - 1], got 0",
        ),
    ],
)
def test_server_config_errors_name_their_source(monkeypatch, capsys, argv, env, line):
    for name, raw in env.items():
        monkeypatch.setenv(name, raw)
    assert run_main(["serve", *argv], capsys) == (2, [f"pagedserve: error: {line}"])


# --- the real process -----------------------------------------------------------------------


def test_bad_config_file_stops_the_process_with_one_line(tmp_path):
    path = write(tmp_path, 'model = "/no/such/model"\nmax_num_seqs = 0\n', "bad.toml")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}
    env["PAGEDSERVE_CACHE"] = str(tmp_path / "empty-cache")  # no model to find, were it to look
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "service.cli", "serve", "--config", path],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"pagedserve: error: config file {path}: max_num_seqs: must be >= 1, got 0"
    ]
    assert proc.stdout == ""
    assert time.monotonic() - start < 60  # imports only: no model is loaded
