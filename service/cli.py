"""The `pagedserve` command line: generate offline, serve, warm a kernel cache, call a server,
manage the model cache.

Settings (engine, server, logging) come from flags, env vars and a config file; see
service/settings.py and docs/CONFIG.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import NoReturn

import grpc

from engine.errors import EngineError
from service.client_commands import add_client_commands
from service.settings import (
    CONFIG_ENV,
    ConfigError,
    Settings,
    add_setting_flags,
    resolve_settings,
)


class _Parser(argparse.ArgumentParser):
    """Usage mistakes, like config mistakes, are one line on stderr and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"pagedserve: error: {message}\n")


def add_settings_args(
    parser: argparse.ArgumentParser, *sections: str, only: tuple[str, ...] | None = None
) -> None:
    parser.add_argument(
        "--config", metavar="FILE", help=f"TOML settings file (env {CONFIG_ENV}); docs/CONFIG.md"
    )
    for section in sections:
        add_setting_flags(parser, section, only)


def cmd_generate(args: argparse.Namespace, settings: Settings) -> int:
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    llm = LLM(config=settings.engine_config())
    params = SamplingParams(
        n=args.n,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed_request,
        stop=args.stop or [],
        ignore_eos=args.ignore_eos,
    )
    if args.chat:
        results = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
    else:
        results = llm.generate(args.prompt, params)
    for result in results:
        for out in result.outputs:
            if args.json:
                record = {
                    "prompt_index": results.index(result),
                    "index": out.index,
                    "text": out.text,
                    "token_ids": out.token_ids,
                    "finish_reason": out.finish_reason.value if out.finish_reason else None,
                    "prompt_tokens": len(result.prompt_token_ids),
                    "completion_tokens": len(out.token_ids),
                    "cached_tokens": result.usage.cached_tokens if result.usage else 0,
                }
                print(json.dumps(record, ensure_ascii=False))
            else:
                print(out.text)
    return 0


def cmd_serve(args: argparse.Namespace, settings: Settings) -> int:
    import asyncio

    from service.serve import serve

    # Both configs are validated here, before serve() starts loading the model.
    engine_config, server_config = settings.engine_config(), settings.server_config()
    return asyncio.run(serve(engine_config, server_config))


def cmd_warmup(args: argparse.Namespace, settings: Settings) -> int:
    """Build the engine as `serve` would, run its warm-up and exit: with kernel_cache_dir
    set, every kernel a server with these settings runs is then in that directory."""
    from engine.core.engine import LLMEngine
    from engine.core.warmup import warm_up

    engine_config = settings.engine_config()
    settings.server_config()  # the same settings as serve: a bad one fails here too
    engine = LLMEngine(engine_config)
    report = warm_up(engine)
    where = engine_config.kernel_cache_dir or "the compilers' default caches"
    print(
        f"warm-up done: {report.num_requests} requests, {report.num_steps} steps; "
        f"{engine.info.startup.describe()}; kernels in {where}"
    )
    return 0


def cmd_models_pull(args: argparse.Namespace, settings: Settings) -> int:
    """Fetch what `serve` would load, with the same settings, and print where it is."""
    from engine.model_store import resolve_model

    config = settings.engine_config()
    print(resolve_model(config.model, config.revision, config.download_dir, force=args.force))
    return 0


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The model as `serve` takes it: a positional MODEL or the `model` setting, and the
    settings that say which revision and where."""
    parser.add_argument(
        "model",
        nargs="?",
        default=argparse.SUPPRESS,  # not given: the model setting (env, config file), as serve
        help="a local path, a Hugging Face repo id (org/name[@revision]) or an alias; unset: "
        "the model setting, else the embedded default",
    )
    add_settings_args(parser, "engine", "log", only=("revision", "download_dir", "log_level"))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pagedserve", description=__doc__)
    add_setting_flags(parser, "log")  # here too, for the commands without settings of their own
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text offline (no server)")
    add_settings_args(gen, "engine", "log")
    gen.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    gen.add_argument(
        "--chat",
        action="store_true",
        help="wrap each prompt as a user message in the chat template",
    )
    gen.add_argument("--n", type=int, default=1)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", dest="seed_request", type=int, default=None, help="sampling seed")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true", help="one JSON object per output")
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="run the gRPC server")
    add_settings_args(srv, "engine", "server", "log")
    srv.set_defaults(func=cmd_serve)

    warm = sub.add_parser(
        "warmup",
        help="build the engine, run its warm-up and exit (fills --kernel-cache-dir)",
    )
    add_settings_args(warm, "engine", "server", "log")
    warm.set_defaults(func=cmd_warmup)

    add_client_commands(sub)

    models = sub.add_parser("models", help="the local model cache")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    pull = models_sub.add_parser(
        "pull",
        help="fetch a model ahead of serving (a repo id into the Hugging Face cache, the "
        "default into ours) and print where it is",
    )
    add_model_args(pull)
    pull.add_argument("--force", action="store_true", help="fetch again what is cached")
    pull.set_defaults(func=cmd_models_pull)
    path = models_sub.add_parser(
        "path", help="print where a --model value resolves to (fetching it if it is not there)"
    )
    add_model_args(path)
    path.set_defaults(func=cmd_models_pull, force=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = resolve_settings(args, os.environ)
        logging.basicConfig(
            level=settings.get("log_level"), format="%(levelname)s %(name)s: %(message)s"
        )
        return args.func(args, settings)
    except (ConfigError, EngineError) as exc:
        print(f"pagedserve: error: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as exc:  # a server's refusal, or no server: one line
        details = " ".join((exc.details() or "").split())
        print(f"pagedserve: {exc.code().name}: {details}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
