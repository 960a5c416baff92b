"""`pagedserve client ...`: every RPC of a running server from the shell, over
clients/client.py. Each command prints its answer on stdout (--json: the response as
JSON). A bad flag value is one line and exit 2 (argparse's rule, at parse time); a server's
refusal is one line, `pagedserve: CODE: message`, and exit 1 (service/cli.py's main)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

from service.settings import ConfigError

UINT32_MAX = 2**32 - 1  # max_tokens is a uint32 on the wire
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # the seed is an int64


def int_in(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high], else one line naming the range."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in [{low}, {high}], got {value}")
        return value

    return parse


def finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def seconds(text: str) -> float:
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text}")
    return value


def prompt_file(path: str) -> str:
    """The text of a file, or of stdin for `-`, as it is (a trailing newline stays)."""
    try:
        data = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
        return data.decode("utf-8")
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        where = "stdin" if path == "-" else path
        raise argparse.ArgumentTypeError(
            f"{where} is not UTF-8 text ({exc.reason} at byte {exc.start})"
        ) from None


def add_client_commands(sub: argparse._SubParsersAction) -> None:
    """The `client` command and its subcommands, one per RPC."""
    connection = argparse.ArgumentParser(add_help=False)
    connection.add_argument("--target", default="localhost:50051", help="host:port of the server")
    connection.add_argument(
        "--api-key", default=None, help="the server's API key (default: env PAGEDSERVE_API_KEY)"
    )
    connection.add_argument("--tls", action="store_true", help="TLS, checked against system CAs")
    connection.add_argument("--ca-file", help="TLS, the server's certificate checked against this")
    connection.add_argument("--cert-file", help="client certificate (PEM), for a server with mTLS")
    connection.add_argument("--key-file", help="the client certificate's key (PEM)")
    connection.add_argument("--timeout", type=seconds, default=120.0, help="deadline in seconds")
    connection.add_argument("--json", action="store_true", help="the whole response as JSON")

    prompt = argparse.ArgumentParser(add_help=False)
    source = prompt.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the prompt text")
    source.add_argument(
        "--prompt-file",
        dest="prompt",
        type=prompt_file,
        metavar="PATH",
        help="the prompt, read from a UTF-8 file as it is; - reads stdin",
    )

    client = sub.add_parser("client", help="call a running server (every RPC)")
    client_sub = client.add_subparsers(dest="client_command", required=True)

    gen = client_sub.add_parser(
        "generate", parents=[connection, prompt], help="Generate (or StreamGenerate) one prompt"
    )
    gen.add_argument("--max-tokens", type=int_in(1, UINT32_MAX), default=64)
    gen.add_argument("--temperature", type=finite_float, default=0.0)
    gen.add_argument("--seed", type=int_in(INT64_MIN, INT64_MAX), default=None)
    gen.add_argument(
        "--request-id", default="", help="an id to Cancel it by (default: the server's)"
    )
    gen.add_argument("--stream", action="store_true", help="StreamGenerate: print text as it comes")
    gen.set_defaults(func=cmd_generate)

    tok = client_sub.add_parser("tokenize", parents=[connection, prompt], help="Tokenize a text")
    tok.add_argument(
        "--no-special-tokens", action="store_true", help="without the BOS token the model adds"
    )
    tok.set_defaults(func=cmd_tokenize)

    info = client_sub.add_parser("model-info", parents=[connection], help="GetModelInfo")
    info.set_defaults(func=cmd_model_info)

    cancel = client_sub.add_parser("cancel", parents=[connection], help="Cancel a request by id")
    cancel.add_argument("request_id", help="the id the request was made with (--request-id)")
    cancel.set_defaults(func=cmd_cancel)


def connect(args: argparse.Namespace):
    """An InferenceClient for the connection flags."""
    from clients.client import InferenceClient

    api_key = args.api_key or os.environ.get("PAGEDSERVE_API_KEY")
    if api_key is not None and not all("!" <= char <= "~" for char in api_key):
        source = "--api-key" if args.api_key else "PAGEDSERVE_API_KEY"
        raise ConfigError(f"{source}: must be visible ASCII (! to ~): it travels in a header")
    tls = dict(tls=args.tls, ca_file=args.ca_file, cert_file=args.cert_file, key_file=args.key_file)
    try:
        return InferenceClient(args.target, api_key=api_key, **tls)
    except (OSError, ValueError) as exc:  # a TLS file missing, or a certificate without key
        raise ConfigError(f"client TLS: {exc}") from None


def as_json(message, indent: int | None = 2, defaults: bool = False) -> str:
    """A response as JSON (protobuf's mapping: lowerCamelCase names); with defaults, the
    fields at their default values too."""
    from google.protobuf.json_format import MessageToJson

    return MessageToJson(
        message, indent=indent, ensure_ascii=False, always_print_fields_with_no_presence=defaults
    )


def cmd_generate(args: argparse.Namespace, settings) -> int:
    from pagedserve.v1 import inference_pb2 as pb

    request = pb.GenerateRequest(
        request_id=args.request_id,
        text=args.prompt,
        sampling=pb.SamplingOptions(temperature=args.temperature),
        stopping=pb.StoppingOptions(max_tokens=args.max_tokens),
    )
    if args.seed is not None:
        request.sampling.seed = args.seed
    with connect(args) as client:
        if args.stream:
            for message in client.stream(request, timeout=args.timeout):
                if args.json:  # one message per line
                    print(as_json(message, indent=None), flush=True)
                else:
                    print(message.text, end="", flush=True)
            if not args.json:
                print()
        else:
            response = client.generate(request, timeout=args.timeout)
            print(as_json(response) if args.json else response.candidates[0].text)
    return 0


def cmd_tokenize(args: argparse.Namespace, settings) -> int:
    with connect(args) as client:
        ids = client.tokenize(args.prompt, not args.no_special_tokens, timeout=args.timeout)
    print(json.dumps(ids) if args.json else " ".join(map(str, ids)))
    return 0


def cmd_model_info(args: argparse.Namespace, settings) -> int:
    with connect(args) as client:
        info = client.model_info(timeout=args.timeout)
    if args.json:
        print(as_json(info, defaults=True))
        return 0
    for field in info.DESCRIPTOR.fields:
        value = getattr(info, field.name)
        if field.is_repeated:
            value = " ".join(map(str, value))
        print(f"{field.name}: {value}")
    return 0


def cmd_cancel(args: argparse.Namespace, settings) -> int:
    with connect(args) as client:
        cancelled = client.cancel(args.request_id, timeout=args.timeout)
    if args.json:
        print(json.dumps({"cancelled": cancelled}))
    else:
        print("cancelled" if cancelled else "not running (unknown, or already finished)")
    return 0
