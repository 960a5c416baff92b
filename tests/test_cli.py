"""The `pagedserve` command line, run in-process and as a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from service.cli import main
from tests.tiny_models import write_tiny_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("cli-tiny"), "qwen2")


def test_generate_json_fields(tiny_model, capsys):
    code = main(
        [
            "generate",
            "--model",
            str(tiny_model),
            "--prompt",
            "hello world",
            "--prompt",
            "abc",
            "--max-tokens",
            "6",
            "--ignore-eos",
            "--json",
            "--num-blocks",
            "64",
        ]
    )
    assert code == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt_index"] for r in records] == [0, 1]
    for r in records:
        assert set(r) >= {
            "text",
            "token_ids",
            "finish_reason",
            "prompt_tokens",
            "completion_tokens",
        }
        assert r["finish_reason"] == "length"
        assert r["completion_tokens"] == len(r["token_ids"]) == 6
        assert r["prompt_tokens"] > 0


def test_generate_takes_engine_settings_from_a_config_file(tiny_model, tmp_path, capsys):
    config = tmp_path / "engine.toml"
    config.write_text(f"model = {str(tiny_model)!r}\nnum_blocks = 64\nmax_model_len = 16\n")
    argv = ["generate", "--config", str(config), "--prompt", "hello world", "--max-tokens", "20"]
    assert main(argv) == 2
    assert "context limit of 16 tokens" in capsys.readouterr().err


def test_unknown_model_is_a_clear_error(capsys):
    code = main(["generate", "--model", "no/such-model", "--prompt", "x"])
    assert code == 2
    err = capsys.readouterr().err
    assert "no/such-model" in err and "alias" in err


def test_bad_sampling_value_is_a_clear_error(tiny_model, capsys):
    code = main(["generate", "--model", str(tiny_model), "--prompt", "x", "--temperature", "-1"])
    assert code == 2
    assert "temperature" in capsys.readouterr().err


@pytest.mark.slow
def test_default_model_answers_a_chat_question():
    """The embedded SmolLM2-135M-Instruct, through the installed console entry point."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "service.cli",
            "generate",
            "--chat",
            "--json",
            "--prompt",
            "What is the capital of France?",
            "--max-tokens",
            "20",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout.splitlines()[0])
    assert "Paris" in record["text"]
    assert record["finish_reason"] in ("eos", "length")


def test_warmup_builds_the_engine_warms_it_up_and_exits(tiny_model, tmp_path):
    cache = tmp_path / "kernels"
    command = [sys.executable, "-m", "service.cli", "warmup", "--model", str(tiny_model)]
    command += ["--num-blocks", "64", "--max-num-seqs", "4", "--kernel-cache-dir", str(cache)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "warm-up done" in done.stdout and str(cache) in done.stdout
    assert (cache / "triton").is_dir()  # pointed at, before anything could compile
