"""Tensor parallelism through the engine on the CPU: `tensor_parallel_size` N starts N - 1
gloo worker processes that follow the driver's steps. The engine's outputs at N ranks are
those of one (greedy, token for token) through chunked prefill, prefix-cache hits,
preemption and n > 1; the embedded SmolLM2 through `pagedserve generate` at 3 ranks is the
one-rank run; a closed engine has left its group at once (no gloo thread left in the
driver, every worker exited 0); a worker killed or hung under `pagedserve serve` fails the
engine, naming the rank, turns readiness NOT_SERVING and ends the server."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import psutil
import pytest

from engine.core.engine import LLMEngine
from engine.errors import ValidationError
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from pagedserve.v1 import inference_pb2 as pb
from pagedserve.v1 import inference_pb2_grpc
from tests.reliability.test_watchdog import NOT_SERVING, SERVING, Health
from tests.server_process import running_server
from tests.test_grpc_server import greedy, serving
from tests.test_tensor_parallel import group_threads
from tests.tiny_models import write_tiny_model

TIMEOUT = 3.0  # seconds a collective waits for a hung rank

# Small blocks and pool, a small step budget: prompts run in chunks, later ones hit the
# prefix cache, and the pool is too small for every sequence at once (preemption).
ENGINE = dict(block_size=4, num_blocks=40, max_num_batched_tokens=24, max_num_seqs=8)
# One process's threads each: three ranks on two cores.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tp-tiny"), "llama")


@pytest.fixture(autouse=True)
def one_thread_per_rank(monkeypatch):
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers take the driver's count
    yield
    torch.set_num_threads(threads)


def run_engine(directory: Path, size: int) -> tuple[list[list[list[int]]], int]:
    """Each request's candidates' tokens, and the preemptions it took; at size > 1, once
    the engine is closed, none of its group's threads is left in this process (they end
    with the group, not at the interpreter's exit, where one still at work aborts it) and
    every worker has exited 0."""
    llm = LLM(str(directory), tensor_parallel_size=size, **ENGINE)
    try:
        shared = list(range(5, 25))  # a prefix of five blocks
        prompts = [shared + [30 + i] * (3 + i) for i in range(6)] + [list(range(40, 75))]
        params = [
            SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, n=1 + i % 2)
            for i in range(len(prompts))
        ]
        outputs = llm.generate(prompts, params)
        preemptions = llm.engine.scheduler.num_preemptions
    finally:
        llm.engine.close()
    if size > 1:
        assert group_threads() == []
        assert [p.returncode for p in llm.engine.workers.processes] == [0] * (size - 1)
    return [[c.token_ids for c in out.outputs] for out in outputs], preemptions


@pytest.mark.parametrize(
    ("arch", "size", "overrides"),
    [
        ("qwen3", 2, {}),
        # 2 KV heads at 3 ranks: repeated to 6, two a rank.
        ("llama", 3, {"num_attention_heads": 6, "hidden_size": 96}),
        (
            "qwen3_moe",
            2,
            {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
        ),
    ],
)
def test_n_ranks_give_one_ranks_tokens(arch: str, size: int, overrides: dict, tmp_path: Path):
    directory = write_tiny_model(tmp_path, arch, **overrides)
    expected, expected_preemptions = run_engine(directory, 1)
    got, preemptions = run_engine(directory, size)
    assert expected_preemptions > 0  # the workload reaches preemption
    assert (got, preemptions) == (expected, expected_preemptions)


def test_more_ranks_than_gpus_are_refused_at_start(tiny_model: Path):
    with pytest.raises(ValidationError, match=r"tensor_parallel_size: 2 ranks need GPUs cuda:0"):
        LLM(str(tiny_model), device="cuda", tensor_parallel_size=2)


def generate_json(model: Path, *args: str) -> list[list[int]]:
    command = [sys.executable, "-m", "service.cli", "generate", "--model", str(model)]
    command += ["--prompt", "The capital of France is", "--prompt", "def fib(n):"]
    command += ["--max-tokens", "24", "--json", "--log-level", "WARNING", *args]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env={**os.environ, **ONE_THREAD}
    )
    assert done.returncode == 0, done.stderr
    return [json.loads(line)["token_ids"] for line in done.stdout.splitlines()]


def test_smollm2_generate_at_three_ranks_is_one_rank(smollm2_gguf: Path):
    """The embedded default: 9 query heads and 3 KV heads, 3 each and 1 each a rank."""
    one = generate_json(smollm2_gguf)
    assert len(one) == 2 and all(len(ids) == 24 for ids in one)
    assert generate_json(smollm2_gguf, "--tensor-parallel-size", "3") == one


def rank_1_pid(core: LLMEngine) -> int:
    """The engine's one worker (at two ranks)."""
    (process,) = core.workers.processes
    return process.pid


@pytest.mark.parametrize(
    ("how", "named"),
    [
        # A killed rank's sockets close: the driver's next collective fails at once.
        (signal.SIGKILL, "tensor-parallel rank 1 (pid {pid}) exited (signal SIGKILL)"),
        # A hung rank answers nothing: the collective gives up after the timeout.
        (signal.SIGSTOP, "a tensor-parallel step failed (no rank exited: one may hang)"),
    ],
    ids=["killed", "hung"],
)
async def test_a_lost_worker_fails_the_streams_and_readiness(
    tiny_model: Path, how: signal.Signals, named: str
):
    async with serving(tiny_model, tensor_parallel_size=2, tensor_parallel_timeout=TIMEOUT) as (
        srv,
        core,
        _,
    ):
        srv.watch_engine(60.0, every=0.1)  # a dead loop trips it at once
        pid = rank_1_pid(core)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            health = Health(channel)
            streams = [
                stub.StreamGenerate(pb.GenerateRequest(text=f"victim {i}", **greedy(240)))
                for i in range(2)
            ]
            for stream in streams:
                assert (await stream.read()).token_ids  # both are running
            assert await health.both() == (SERVING, SERVING)
            os.kill(pid, how)
            lost_at = time.monotonic()
            for stream in streams:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    while await stream.read() is not grpc.aio.EOF:
                        pass
                assert err.value.code() == grpc.StatusCode.INTERNAL
                assert named.format(pid=pid) in err.value.details()
            # Within the collectives' timeout (a hang), at once (an exit).
            assert time.monotonic() - lost_at < TIMEOUT + 2
            assert await health.wait_for(NOT_SERVING, timeout=2) < 2
            assert named.format(pid=pid) in await asyncio.wait_for(srv.watchdog, 5)
        if how == signal.SIGSTOP:
            # The engine's end killed the hung worker: nothing is left behind.
            assert psutil.pid_exists(pid) is False or psutil.Process(pid).status() == "zombie"


def test_a_server_at_two_ranks_serves_then_ends_when_a_worker_dies_idle(tiny_model: Path):
    """`pagedserve serve --tensor-parallel-size 2`: ready after its warm-up, it answers as
    one rank does and reports its pool on /metrics; then, with no request running, a
    killed worker is found by the engine loop's own check and the server exits 1 (for
    Kubernetes to restart it), naming the rank."""
    args = ("--num-blocks", "64", "--block-size", "4")
    request = pb.GenerateRequest(text="two ranks", **greedy(12))
    with running_server(tiny_model, *args, env=ONE_THREAD) as server:
        with grpc.insecure_channel(server.target) as channel:
            want = inference_pb2_grpc.InferenceStub(channel).Generate(request, timeout=60)
    with running_server(tiny_model, *args, "--tensor-parallel-size", "2", env=ONE_THREAD) as server:
        with grpc.insecure_channel(server.target) as channel:
            got = inference_pb2_grpc.InferenceStub(channel).Generate(request, timeout=60)
        assert got.candidates[0].token_ids == want.candidates[0].token_ids
        assert server.metrics()["pagedserve_kv_cache_blocks_total"] == 64
        (worker,) = [
            p
            for p in psutil.Process(server.proc.pid).children()
            if "engine.parallel.worker" in p.cmdline()
        ]
        worker.kill()
        assert server.proc.wait(timeout=10) == 1
        log = server.stderr()
        assert "engine loop is dead" in log, log[-2000:]
        assert f"tensor-parallel rank 1 (pid {worker.pid}) exited (signal SIGKILL)" in log
