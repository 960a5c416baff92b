"""Models by Hugging Face repo id (`--model org/name[@revision]`), with no network.

A hub cache is built here in huggingface_hub's documented layout
(models--org--name/{blobs,refs/<branch>,snapshots/<commit>/...}) holding a tiny random model,
and huggingface_hub's own snapshot_download finds it offline: in a child process through
HF_HUB_CACHE and HF_HUB_OFFLINE=1, as a deployment sets them; in this process through the
download_dir setting with its offline switch set.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx2
import huggingface_hub
import pytest
from huggingface_hub import constants
from huggingface_hub.errors import (
    GatedRepoError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import filter_repo_objects

from engine.errors import ModelLoadError
from engine.model_hub import SERVING_FILES, served_name
from engine.model_store import resolve_model
from pagedserve.v1 import inference_pb2 as pb
from pagedserve.v1 import inference_pb2_grpc
from service.cli import main
from tests.server_process import free_port, running_server
from tests.tiny_models import write_tiny_model

REPO = "tiny-org/tiny-llama"
MAIN_COMMIT = hashlib.sha1(b"main").hexdigest()
V2_COMMIT = hashlib.sha1(b"v2").hexdigest()


@dataclass(frozen=True)
class HubCache:
    root: Path  # what HF_HUB_CACHE names
    main: Path  # the snapshot refs/main names
    v2: Path  # the snapshot refs/v2 names


def lay_out_snapshot(cache: Path, repo_id: str, ref: str, commit: str, files: Path) -> Path:
    """The files of `files` as the hub cache holds a snapshot: each file's bytes once in
    blobs/, linked from snapshots/<commit>/, and refs/<ref> holding the commit hash."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for file in sorted(files.iterdir()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)  # no newline, as huggingface_hub writes it
    return snapshot


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> HubCache:
    source = write_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")
    root = tmp_path_factory.mktemp("hub-cache")
    main_snapshot = lay_out_snapshot(root, REPO, "main", MAIN_COMMIT, source)
    # v2: another commit, sharing the weights' blob, with a shorter context in its config
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 256}))
    v2_snapshot = lay_out_snapshot(root, REPO, "v2", V2_COMMIT, source)
    return HubCache(root, main_snapshot, v2_snapshot)


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """HF_HUB_OFFLINE=1 for this process (huggingface_hub reads the variable on import)."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def offline_env(hub: HubCache, tmp_path: Path) -> dict[str, str]:
    """A child's environment: the cache built here, offline, no token from this machine."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "PAGEDSERVE_"))}
    env.update(HF_HUB_CACHE=str(hub.root), HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    return env


def pagedserve(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "service.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)


# ---- resolving, in this process ---------------------------------------------------------------


def test_a_repo_id_resolves_to_the_snapshot_its_main_branch_names(hub, offline):
    assert resolve_model(REPO, download_dir=str(hub.root)) == hub.main


@pytest.mark.parametrize(
    "model, revision",
    [(REPO, "v2"), (f"{REPO}@v2", None), (f"{REPO}@v2", "v2"), (f"{REPO}@{V2_COMMIT}", None)],
)
def test_a_revision_picks_its_own_snapshot(hub, offline, model, revision):
    assert resolve_model(model, revision, download_dir=str(hub.root)) == hub.v2


def test_a_revision_given_both_ways_must_agree(hub, offline, capsys):
    argv = ["models", "path", f"{REPO}@v2", "--revision", "v3", "--download-dir", str(hub.root)]
    assert main(argv) == 2
    assert capsys.readouterr().err.splitlines() == [
        "pagedserve: error: argument --revision: 'v3' disagrees with the model's own @v2 "
        "('tiny-org/tiny-llama@v2'); give it once"
    ]


def test_a_local_path_wins_over_a_repo_id_spelt_the_same(hub, offline, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    local = tmp_path / REPO
    local.mkdir(parents=True)
    assert resolve_model(REPO, download_dir=str(hub.root)) == Path(REPO)
    with pytest.raises(ModelLoadError) as info:
        resolve_model(str(local), "v2", download_dir=str(hub.root))
    assert str(info.value) == (
        f"--revision 'v2' applies to a Hugging Face repo id (org/name), and --model "
        f"'{local}' is a local path"
    )


def test_a_snapshot_is_served_under_its_repo_id(hub):
    assert served_name(hub.main) == REPO
    assert served_name(hub.main / "model.gguf") == "model.gguf"  # a file in a snapshot
    assert served_name(Path("/models/Qwen3-8B")) == "Qwen3-8B"


# ---- the CLI and the server, as child processes with HF_HUB_CACHE and HF_HUB_OFFLINE=1 -------


def test_serve_by_repo_id_answers_grpc_and_rest(hub, tmp_path):
    http_port = free_port()
    args = ("--http-port", str(http_port), "--num-blocks", "64", "--max-num-seqs", "4")
    with running_server(REPO, *args, env=offline_env(hub, tmp_path)) as server:
        with grpc.insecure_channel(server.target) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            stopping = pb.StoppingOptions(max_tokens=4, ignore_eos=True)
            request = pb.GenerateRequest(text="hello world", stopping=stopping)
            candidate = stub.Generate(request, timeout=60).candidates[0]
            assert len(candidate.token_ids) == 4
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
            assert info.name == REPO
        base = f"http://127.0.0.1:{http_port}"
        models = json.load(urllib.request.urlopen(f"{base}/v1/models", timeout=10))
        assert [m["id"] for m in models["data"]] == [REPO]
        body = {"model": REPO, "prompt": "hello", "max_tokens": 3, "ignore_eos": True}
        request = urllib.request.Request(
            f"{base}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        completion = json.load(urllib.request.urlopen(request, timeout=60))
        assert completion["model"] == REPO
        assert completion["usage"]["completion_tokens"] == 3


def test_models_pull_offline_prints_the_snapshot(hub, tmp_path):
    env = offline_env(hub, tmp_path)
    done = pagedserve("models", "pull", REPO, env=env)
    assert (done.returncode, done.stdout, done.stderr) == (0, f"{hub.main}\n", "")
    # No MODEL argument: the model setting, as serve reads it, and its revision setting
    env.update(PAGEDSERVE_MODEL=REPO, PAGEDSERVE_REVISION="v2")
    done = pagedserve("models", "pull", env=env)
    assert (done.returncode, done.stdout, done.stderr) == (0, f"{hub.v2}\n", "")


@pytest.mark.parametrize(
    "argv, error",
    [
        (
            ["models", "pull", "tiny-org/absent"],
            "model 'tiny-org/absent' is not in the Hugging Face cache ({cache}) and "
            "HF_HUB_OFFLINE is set: pull it where the Hub can be reached (pagedserve models "
            "pull tiny-org/absent), or unset HF_HUB_OFFLINE",
        ),
        (
            ["serve", "--model", "tiny-org/absent", "--grpc-port", "0"],
            "model 'tiny-org/absent' is not in the Hugging Face cache ({cache}) and "
            "HF_HUB_OFFLINE is set: pull it where the Hub can be reached (pagedserve models "
            "pull tiny-org/absent), or unset HF_HUB_OFFLINE",
        ),
        (
            ["models", "pull", f"{REPO}@v9"],
            "model 'tiny-org/tiny-llama' has no revision 'v9' in the Hugging Face cache "
            "({cache}; cached: main, v2) and HF_HUB_OFFLINE is set: pull it where the Hub can "
            "be reached (pagedserve models pull tiny-org/tiny-llama@v9), or unset HF_HUB_OFFLINE",
        ),
    ],
)
def test_offline_misses_are_one_line_and_exit_2(hub, tmp_path, argv, error):
    done = pagedserve(*argv, env=offline_env(hub, tmp_path))
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"pagedserve: error: {error.format(cache=hub.root)}"]


# ---- what is asked of the Hub, and its refusals ------------------------------------------------
# The Hub cannot be reached from here: snapshot_download is replaced by a stand-in that records
# its arguments or raises huggingface_hub's own exception classes, as the real one does.


def http_error(cls: type[Exception], status: int, message: str) -> Exception:
    request = httpx2.Request("GET", f"https://huggingface.co/api/models/{REPO}")
    return cls(message, response=httpx2.Response(status, request=request))


def no_network() -> Exception:
    error = LocalEntryNotFoundError("An error happened while trying to locate the files")
    error.__cause__ = httpx2.ConnectError("[Errno -2] Name or service not known")
    return error


@pytest.mark.parametrize(
    "raised, token, error",
    [
        (
            http_error(RepositoryNotFoundError, 404, "404 Client Error.\nRepository Not Found"),
            None,
            "--model 'tiny-org/tiny-llama' is not a local path, and the Hugging Face Hub has no "
            "model repo 'tiny-org/tiny-llama' (a private one needs HF_TOKEN set to a token that "
            "can read it)",
        ),
        (
            http_error(GatedRepoError, 401, "401 Client Error.\nCannot access gated repo"),
            None,
            "model 'tiny-org/tiny-llama' is gated on the Hugging Face Hub and no token was "
            "given: accept its terms at https://huggingface.co/tiny-org/tiny-llama and set "
            "HF_TOKEN to a token of that account",
        ),
        (
            http_error(GatedRepoError, 403, "403 Client Error.\nAccess to model is restricted"),
            "hf_test",
            "model 'tiny-org/tiny-llama' is gated on the Hugging Face Hub and the token given "
            "(HF_TOKEN) has no access to it: accept its terms at "
            "https://huggingface.co/tiny-org/tiny-llama with the token's account",
        ),
        (
            http_error(RevisionNotFoundError, 404, "404 Client Error.\nRevision Not Found"),
            None,
            "model 'tiny-org/tiny-llama' has no revision 'main' on the Hugging Face Hub: pass "
            "an existing branch, tag or commit (--revision, or tiny-org/tiny-llama@<revision>)",
        ),
        (
            no_network(),
            None,
            "model 'tiny-org/tiny-llama' is not in the Hugging Face cache ({cache}) and the Hub "
            "cannot be reached (ConnectError: [Errno -2] Name or service not known): check the "
            "network (or HF_ENDPOINT), or pull it where the Hub can be reached (pagedserve "
            "models pull tiny-org/tiny-llama)",
        ),
    ],
    ids=["no-such-repo", "gated-no-token", "gated-token", "no-such-revision", "no-network"],
)
def test_hub_refusals_are_one_line_and_exit_2(tmp_path, monkeypatch, capsys, raised, token, error):
    def refuse(*args, **kwargs):
        raise raised

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    if token:
        monkeypatch.setenv("HF_TOKEN", token)
    assert main(["models", "pull", REPO, "--download-dir", str(tmp_path)]) == 2
    expected = f"pagedserve: error: {error.format(cache=tmp_path)}"
    assert capsys.readouterr().err.splitlines() == [expected]


# A repo as the Hub lists one: the weights twice over (shards and Mistral's own layout), other
# formats beside them, and files serving never reads.
LISTING = [
    ".gitattributes",
    "README.md",
    "config.json",
    "generation_config.json",
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
    "model.safetensors.index.json",
    "consolidated.safetensors",
    "params.json",
    "pytorch_model.bin",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "onnx/model.safetensors",
    "original/consolidated.00.pth",
]
SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


@pytest.mark.parametrize(
    "listing, weights",
    [
        (LISTING, SHARDS),
        # No index: every top-level .safetensors, none from a subfolder
        ([name for name in LISTING if "index" not in name], [*SHARDS, "consolidated.safetensors"]),
    ],
    ids=["index", "no-index"],
)
def test_only_what_serving_reads_is_fetched(tmp_path, monkeypatch, listing, weights):
    """Two passes, as huggingface_hub's own filter reads their patterns: the metadata, then
    the weights (the shards the index names), at the commit the first pass found."""
    snapshot = tmp_path / "snapshots" / MAIN_COMMIT
    fetched: list[tuple[str | None, set[str]]] = []

    def fake(repo_id, *, revision, allow_patterns, ignore_patterns, **kwargs):
        assert repo_id == REPO and kwargs["cache_dir"] is None
        chosen = filter_repo_objects(
            listing, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns
        )
        fetched.append((revision, set(chosen)))
        for name in fetched[-1][1]:
            (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
            weight_map = {"layer.0": SHARDS[0], "layer.1": SHARDS[1]}
            content = {"weight_map": weight_map} if name.endswith("index.json") else {}
            (snapshot / name).write_text(json.dumps(content))
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    assert resolve_model(f"{REPO}@v2") == snapshot
    metadata = {name for name in listing if name in SERVING_FILES}
    assert fetched == [("v2", metadata), (MAIN_COMMIT, set(weights))]


def test_a_repo_without_safetensors_is_refused(tmp_path, monkeypatch):
    snapshot = tmp_path / "snapshots" / MAIN_COMMIT
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: str(snapshot))
    with pytest.raises(ModelLoadError) as info:
        resolve_model(REPO)
    assert str(info.value) == (
        f"model 'tiny-org/tiny-llama' has no .safetensors weights ({snapshot}; "
        "pytorch_model.bin is not supported, and of a GGUF repo download the .gguf file and "
        "pass its path)"
    )
