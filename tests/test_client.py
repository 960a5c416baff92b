"""The ways to call a server that clients/README.md shows, run against one real
`pagedserve serve`: its Python examples, its `pagedserve client` lines (through a shell), and
its grpcurl requests (grpcurl itself is not installable here: each line's method is looked
up through the server's reflection, as grpcurl does, and its -d body parsed into that
method's request with protobuf's JSON mapping, as grpcurl does). Then `pagedserve client`
against live requests: cancel, request ids, and a server's refusals as one line."""

from __future__ import annotations

import io
import re
import shlex
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from google.protobuf import json_format, message_factory
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from pagedserve.v1 import inference_pb2 as pb
from pagedserve.v1 import inference_pb2_grpc
from service.cli import main
from service.grpc.handlers import SERVICE_NAME
from tests.server_process import running_server
from tests.tiny_models import write_tiny_model

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "clients" / "README.md").read_text()
EXAMPLE_TARGET = "localhost:50051"
LONG_CONTEXT = 32768  # the tiny model's context, and its KV pool's tokens (16 a block)
KV_BLOCKS = LONG_CONTEXT // 16


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # A context of 32k tokens: long_stream's request outlasts any CLI process's start.
    model = write_tiny_model(
        tmp_path_factory.mktemp("client-tiny"), "llama", max_position_embeddings=LONG_CONTEXT
    )
    with running_server(model, "--num-blocks", str(KV_BLOCKS)) as process:
        yield process


def section(title: str) -> str:
    """The README's text under a `## title` heading, up to the next one."""
    return README.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def shell_lines(text: str, command: str) -> list[str]:
    """The indented command lines of `text` that run `command` (continuations joined)."""
    joined = re.sub(r"\\\n\s*", "", text)
    return [
        line.strip()
        for line in joined.splitlines()
        if line.startswith("    ") and command in line and EXAMPLE_TARGET in line
    ]


def cli(*args: str, stdin: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "service.cli", "client", *args]
    return subprocess.run(
        command, input=stdin, capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


# ---- the README's examples ---------------------------------------------------------------


def test_readme_python_example_runs_every_rpc(server):
    (code,) = re.findall(r"```python\n(.*?)```", section("Python"), re.S)
    code = code.replace(EXAMPLE_TARGET, server.target)
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    assert "cancelled: True\nFINISH_REASON_CANCELLED\n" in done.stdout
    assert "\nSERVING\n" in done.stdout
    assert f"'{SERVICE_NAME}'" in done.stdout and "'grpc.health.v1.Health'" in done.stdout
    assert 'architecture: "LlamaForCausalLM"' in done.stdout  # the ModelInfo printed


def test_readme_shell_examples_run(server, capsys, monkeypatch):
    """Each `pagedserve client` line exits 0 with an answer. Run in this process (each
    command's own process would import torch again); `echo TEXT |` is its stdin."""
    lines = shell_lines(section("From the shell"), "pagedserve client")
    commands = set()
    for line in lines:
        pipe, _, command = line.rpartition("| ")
        if pipe:
            echoed = shlex.split(pipe)
            assert echoed[0] == "echo", line
            monkeypatch.setattr(
                sys, "stdin", io.TextIOWrapper(io.BytesIO(f"{echoed[1]}\n".encode()))
            )
        argv = shlex.split(command.replace(EXAMPLE_TARGET, server.target))
        assert argv[:2] == ["pagedserve", "client"], line
        commands.add(argv[2])
        assert main(argv[1:]) == 0, (line, capsys.readouterr().err)
        assert capsys.readouterr().out.strip(), line
    assert commands == {"generate", "cancel", "tokenize", "model-info"}


def grpcurl(target: str, line: str):
    """What a README grpcurl line does: list, describe, or one call; returns the answers."""
    args = shlex.split(line)[1:]
    body, metadata, rest = "{}", [], []
    while args:
        arg = args.pop(0)
        if arg == "-d":
            body = args.pop(0)
        elif arg == "-H":
            key, _, value = args.pop(0).partition(": ")
            metadata.append((key.lower(), value))
        elif arg != "-plaintext":
            rest.append(arg)
    _, verb, *symbol = rest
    with grpc.insecure_channel(target) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        if verb == "list":
            return database.get_services()
        pool = DescriptorPool(database)
        if verb == "describe":
            return [pool.FindServiceByName(symbol[0]).full_name]
        service, _, name = verb.rpartition("/")
        method = pool.FindServiceByName(service).methods_by_name[name]
        request_class = message_factory.GetMessageClass(method.input_type)
        response_class = message_factory.GetMessageClass(method.output_type)
        request = json_format.Parse(body, request_class())
        kind = channel.unary_stream if method.server_streaming else channel.unary_unary
        call = kind(
            f"/{verb}",
            request_serializer=request_class.SerializeToString,
            response_deserializer=response_class.FromString,
        )
        answer = call(request, metadata=metadata or None, timeout=60)
        return list(answer) if method.server_streaming else [answer]


def test_readme_grpcurl_requests_cover_every_rpc_and_are_answered(server):
    lines = shell_lines(section("grpcurl"), "grpcurl")
    calls = {shlex.split(line)[-1] for line in lines}
    rpcs = {f"{SERVICE_NAME}/{m.name}" for m in pb.DESCRIPTOR.services_by_name["Inference"].methods}
    assert calls >= rpcs | {"list", "grpc.health.v1.Health/Check"}, calls
    for line in lines:
        answers = grpcurl(server.target, line)
        assert answers, line
        if line.endswith("list"):
            assert SERVICE_NAME in answers and "grpc.health.v1.Health" in answers
        if line.endswith("/Generate"):
            assert answers[0].usage.completion_tokens == 16
        if line.endswith("/StreamGenerate"):  # it ran to its end
            assert answers[-1].finish_reason


# ---- pagedserve client against live requests ---------------------------------------------
# A few runs as the user runs it (its own process: stdin, stdout, the exit code, nothing
# but one line on stderr); the rest through main() in this process, which is the same code
# without a second torch import per command.


def long_stream(target: str, request_id: str):
    """A request that runs until cancelled, already running; its channel too. Its tokens
    take the tiny model tens of seconds: a cold `pagedserve client` process, which a busy
    machine can take seconds to start, still finds it running."""
    channel = grpc.insecure_channel(target)
    stopping = pb.StoppingOptions(max_tokens=LONG_CONTEXT - 100, ignore_eos=True)
    request = pb.GenerateRequest(request_id=request_id, text="once", stopping=stopping)
    stream = inference_pb2_grpc.InferenceStub(channel).StreamGenerate(request)
    next(stream)
    return channel, stream


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """main(["client", *argv]) in this process: its exit code, stdout and stderr."""
    code = main(["client", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_cancel_ends_a_live_request_by_its_id(server, capsys):
    channel, stream = long_stream(server.target, "job-7")
    with channel:
        done = cli("cancel", "--target", server.target, "job-7")
        assert (done.returncode, done.stdout, done.stderr) == (0, "cancelled\n", "")
        assert [m.finish_reason for m in stream][-1] == pb.FINISH_REASON_CANCELLED
    assert run(capsys, "cancel", "--target", server.target, "job-7", "--json") == (
        0,
        '{"cancelled": false}\n',
        "",
    )


def test_cli_request_id_and_a_servers_refusal_in_one_line(server, capsys):
    args = ["--target", server.target, "--prompt", "hi", "--max-tokens", "3", "--json"]
    code, out, _ = run(capsys, "generate", *args, "--request-id", "job-8")
    assert code == 0 and '"requestId": "job-8"' in out
    channel, _ = long_stream(server.target, "job-9")
    with channel:
        done = cli("generate", *args, "--request-id", "job-9")
        assert (done.returncode, done.stdout) == (1, "")
        assert re.fullmatch(
            r"pagedserve: ALREADY_EXISTS: request_id: 'job-9' is already running[^\n]*\n",
            done.stderr,
        ), done.stderr
        refusals = [  # (flags, the start of the one line on stderr)
            (["--request-id", "job 9"], "pagedserve: INVALID_ARGUMENT: request_id: character 3"),
            (["--temperature", "-1"], "pagedserve: INVALID_ARGUMENT: temperature: "),
            (["--max-tokens", "100000"], "pagedserve: INVALID_ARGUMENT: max_tokens: "),
        ]
        for flags, start in refusals:
            code, out, err = run(capsys, "generate", *args, *flags)
            assert (code, out) == (1, ""), err
            (line,) = err.splitlines()
            assert line.startswith(start), line


def test_cli_prompt_from_stdin_or_a_file_is_the_prompt_as_it_is(server, tmp_path, capsys):
    text = "héllo wörld\n"
    code, expected, _ = run(capsys, "tokenize", "--target", server.target, "--prompt", text)
    assert code == 0 and len(expected.split()) > 2
    done = cli("tokenize", "--target", server.target, "--prompt-file", "-", stdin=text)
    assert (done.returncode, done.stdout, done.stderr) == (0, expected, "")
    (tmp_path / "prompt.txt").write_text(text, encoding="utf-8")
    from_file = ["--prompt-file", str(tmp_path / "prompt.txt")]
    assert run(capsys, "tokenize", "--target", server.target, *from_file) == (0, expected, "")


def test_cli_model_info_and_tokenize(server, capsys):
    code, out, _ = run(capsys, "model-info", "--target", server.target)
    assert code == 0
    info = dict(line.split(": ", 1) for line in out.splitlines())
    assert info["architecture"] == "LlamaForCausalLM" and info["kv_num_blocks"] == str(KV_BLOCKS)
    argv = ["tokenize", "--target", server.target, "--prompt", "hello", "--no-special-tokens"]
    code, out, _ = run(capsys, *argv)
    with grpc.insecure_channel(server.target) as channel:
        ids = inference_pb2_grpc.InferenceStub(channel).Tokenize(pb.TokenizeRequest(text="hello"))
    assert (code, out.split()) == (0, [str(i) for i in ids.token_ids])


def test_cli_a_server_that_is_not_there_is_one_line(capsys):
    code, out, err = run(capsys, "model-info", "--target", "127.0.0.1:1", "--timeout", "5")
    assert (code, out) == (1, "")
    (line,) = err.splitlines()
    assert line.startswith("pagedserve: UNAVAILABLE: "), line
