"""The `pagedserve` command line: generate offline, manage the model cache."""

from __future__ import annotations

import argparse
import json
import logging
import sys

import grpc

from engine.errors import EngineError


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=None,
        help="HF model dir, .gguf file or alias (default: embedded SmolLM2-135M-Instruct)",
    )
    g.add_argument("--device", default=None, help="auto | cpu | cuda[:N]")
    g.add_argument("--dtype", default=None, help="auto | float32 | bfloat16 | float16")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument(
        "--engine-seed",
        dest="engine_seed",
        type=int,
        default=None,
        help="seeds draws for requests that bring no seed",
    )
    g.add_argument("--block-size", type=int, default=None)
    g.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="KV blocks (default: from --kv-cache-memory-gib)",
    )
    g.add_argument("--kv-cache-memory-gib", type=float, default=None)
    g.add_argument(
        "--no-prefix-caching", dest="enable_prefix_caching", action="store_false", default=None
    )
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument(
        "--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false", default=None
    )


ENGINE_KEYS = (
    "model device dtype max_model_len block_size num_blocks kv_cache_memory_gib "
    "enable_prefix_caching max_num_seqs max_num_batched_tokens enable_chunked_prefill"
).split()


def engine_settings(args: argparse.Namespace) -> dict:
    return {"seed": args.engine_seed, **{k: getattr(args, k) for k in ENGINE_KEYS}}


def cmd_generate(args: argparse.Namespace) -> int:
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    llm = LLM(**engine_settings(args))
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


def cmd_serve(args: argparse.Namespace) -> int:
    import asyncio

    from engine.async_engine import AsyncEngine
    from engine.config import engine_config_from_flat
    from engine.engine import LLMEngine
    from service.server import ServerConfig, serve

    engine = LLMEngine(engine_config_from_flat(**engine_settings(args)))
    async_engine = AsyncEngine(engine, args.max_queued_requests)
    async_engine.start()
    config = ServerConfig(
        host=args.host,
        grpc_port=args.grpc_port,
        drain_seconds=args.drain_seconds,
    )
    asyncio.run(serve(async_engine, engine.model_path.name, config))
    return 0


def cmd_client_generate(args: argparse.Namespace) -> int:
    from google.protobuf.json_format import MessageToJson

    from clients.client import InferenceClient
    from pagedserve.v1 import inference_pb2 as pb

    request = pb.GenerateRequest(
        text=args.prompt,
        sampling=pb.SamplingOptions(temperature=args.temperature),
        stopping=pb.StoppingOptions(max_tokens=args.max_tokens),
    )
    if args.seed is not None:
        request.sampling.seed = args.seed
    with InferenceClient(args.target) as client:
        if args.stream:
            for message in client.stream(request, timeout=args.timeout):
                print(message.text, end="", flush=True)
            print()
        else:
            response = client.generate(request, timeout=args.timeout)
            print(MessageToJson(response) if args.json else response.candidates[0].text)
    return 0


def cmd_models_pull(args: argparse.Namespace) -> int:
    from engine.model_store import pull_default_model

    print(pull_default_model(force=args.force))
    return 0


def cmd_models_path(args: argparse.Namespace) -> int:
    from engine.model_store import resolve_model

    print(resolve_model(args.model))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__)
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text offline (no server)")
    add_engine_args(gen)
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
    add_engine_args(srv)
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--grpc-port", type=int, default=50051)
    srv.add_argument("--max-queued-requests", type=int, default=1024)
    srv.add_argument("--drain-seconds", type=float, default=30.0)
    srv.set_defaults(func=cmd_serve)

    client = sub.add_parser("client", help="call a running server")
    client_sub = client.add_subparsers(dest="client_command", required=True)
    cgen = client_sub.add_parser("generate", help="Generate / StreamGenerate one prompt")
    cgen.add_argument("--target", default="localhost:50051")
    cgen.add_argument("--prompt", required=True)
    cgen.add_argument("--max-tokens", type=int, default=64)
    cgen.add_argument("--temperature", type=float, default=0.0)
    cgen.add_argument("--seed", type=int, default=None)
    cgen.add_argument("--stream", action="store_true")
    cgen.add_argument("--json", action="store_true", help="the whole response as JSON")
    cgen.add_argument("--timeout", type=float, default=120.0, help="deadline in seconds")
    cgen.set_defaults(func=cmd_client_generate)

    models = sub.add_parser("models", help="the local model cache")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    pull = models_sub.add_parser("pull", help="fetch the embedded default model into the cache")
    pull.add_argument("--force", action="store_true")
    pull.set_defaults(func=cmd_models_pull)
    path = models_sub.add_parser("path", help="print where a --model value resolves to")
    path.add_argument("model", nargs="?", default=None)
    path.set_defaults(func=cmd_models_path)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except EngineError as exc:
        print(f"pagedserve: error: {exc}", file=sys.stderr)
        return 2
    except grpc.RpcError as exc:
        print(f"pagedserve: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
