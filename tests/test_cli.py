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
    code = main(["generate", "--model", "no-such-model", "--prompt", "x"])
    assert code == 2
    err = capsys.readouterr().err
    assert "no-such-model" in err and "alias" in err


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


# ---- pagedserve client: flag values ----------------------------------------------------------


def test_client_bad_flag_value_is_one_line_and_exit_2_in_a_real_process():
    command = [sys.executable, "-m", "service.cli", "client", "generate", "--prompt", "x"]
    done = subprocess.run(
        command + ["--max-tokens", "-5"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (
        "pagedserve: error: argument --max-tokens: must be in [1, 4294967295], got -5\n"
    )


P = ["--prompt", "x"]


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["generate", *P, "--max-tokens", "x"],
            "argument --max-tokens: must be an integer, got 'x'",
        ),
        (["generate", *P, "--max-tokens", "4294967296"], "argument --max-tokens: must be in [1, "),
        (["generate", *P, "--temperature", "nan"], "argument --temperature: must be a finite"),
        (["generate", *P, "--seed", str(2**63)], "argument --seed: must be in [-922337203685477"),
        (["generate", *P, "--timeout", "0"], "argument --timeout: must be > 0 seconds, got 0"),
        (["model-info", "--timeout", "-1"], "argument --timeout: must be > 0 seconds, got -1"),
        (["tokenize", "--prompt-file", "/no/such/file"], "cannot read /no/such/file: No such"),
        (["generate", *P, "--prompt-file", __file__], "not allowed with argument --prompt"),
        (["generate"], "one of the arguments --prompt --prompt-file is required"),
        (["cancel"], "the following arguments are required: request_id"),
    ],
)
def test_client_bad_flag_values_are_one_line_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as done:
        main(["client", *argv, "--target", "127.0.0.1:1"])
    assert done.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("pagedserve: error: ") and message in line, line


def test_client_prompt_file_that_is_not_utf8_and_a_key_that_cannot_be_sent(tmp_path, capsys):
    binary = tmp_path / "weights.bin"
    binary.write_bytes(b"\x00\xff\xfe")
    with pytest.raises(SystemExit) as done:
        main(["client", "tokenize", "--prompt-file", str(binary)])
    assert done.value.code == 2
    assert "is not UTF-8 text" in capsys.readouterr().err
    argv = ["client", "model-info", "--target", "127.0.0.1:1", "--api-key", "clé"]
    assert main(argv) == 2  # before any call: gRPC would refuse the header itself
    (line,) = capsys.readouterr().err.splitlines()
    assert (
        line
        == "pagedserve: error: --api-key: must be visible ASCII (! to ~): it travels in a header"
    )
