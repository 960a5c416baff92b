"""Models by Hugging Face repo id (`org/name[@revision]`), fetched with huggingface_hub.

huggingface_hub does the work and reads its own environment: HF_HOME / HF_HUB_CACHE (where the
cache is), HF_TOKEN (gated and private repos), HF_HUB_OFFLINE (the cache only), HF_ENDPOINT,
HF_HUB_DISABLE_PROGRESS_BARS. A snapshot lands in its cache as
`models--org--name/snapshots/<commit>/`, its files linked to `blobs/`, `refs/<branch>` naming the
commit; that directory is what the loader reads. Only what serving reads is fetched, and each of
its errors becomes one ModelLoadError line that names the model and what to do.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from engine.errors import ModelLoadError, ValidationError

# What the loader and the tokenizer read besides the weights (engine/model/loader.py,
# engine/text/tokenizer.py). The weights come in a second pass: the shards the index names.
SERVING_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
# Subfolders (original/, onnx/, ...) hold other formats of the same weights; the loader reads
# only the top level. fnmatch's `*` crosses `/`, so "*.safetensors" alone would take them too.
_SUBFOLDERS = ["*/*"]

# An org and a name as the Hub spells them, and an optional @revision. Anything else (an
# absolute or ./ path, a bare name) is not taken for a repo id.
_REPO_ID = re.compile(r"(?P<repo_id>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>.*))?")


@dataclass(frozen=True)
class HubModel:
    """A model repo on the Hugging Face Hub, at a branch, tag or commit."""

    repo_id: str  # org/name
    revision: str | None = None  # None: the repo's default branch

    @classmethod
    def parse(cls, name: str, revision: str | None = None) -> HubModel | None:
        """`org/name[@revision]` with the `revision` setting merged in; None if `name` is not
        written as a repo id. ValidationError if the two revisions disagree."""
        match = _REPO_ID.fullmatch(name)
        if match is None:
            return None
        own = match["revision"]
        if own == "":
            raise ValidationError("model", f"{name!r} has an empty revision after '@'")
        if own is not None and revision is not None and own != revision:
            raise ValidationError(
                "revision",
                f"{revision!r} disagrees with the model's own @{own} ({name!r}); give it once",
            )
        return cls(match["repo_id"], own if own is not None else revision)

    @property
    def name(self) -> str:
        return self.repo_id if self.revision is None else f"{self.repo_id}@{self.revision}"

    def fetch(self, cache_dir: str | None = None, force: bool = False) -> Path:
        """The snapshot directory, fetched into the hub cache (`cache_dir`, else
        huggingface_hub's HF_HUB_CACHE) unless there already; `force` fetches it again."""
        from huggingface_hub import snapshot_download

        def download(revision: str | None, patterns: list[str]) -> Path:
            return Path(
                snapshot_download(
                    self.repo_id,
                    revision=revision,
                    cache_dir=cache_dir,
                    allow_patterns=patterns,
                    ignore_patterns=_SUBFOLDERS,
                    force_download=force,
                    library_name="pagedserve",
                )
            )

        try:
            snapshot = download(self.revision, list(SERVING_FILES))
            # The weights at the commit the first pass found (the snapshot's name), so a
            # branch that moves meanwhile cannot mix two commits.
            snapshot = download(snapshot.name, self._weight_files(snapshot))
        except ModelLoadError:
            raise
        except Exception as exc:  # every refusal of the Hub or the cache becomes one line
            raise hub_error(self, exc, cache_dir) from exc
        if not any(snapshot.glob("*.safetensors")):
            raise ModelLoadError(
                f"model {self.name!r} has no .safetensors weights ({snapshot}; pytorch_model.bin "
                "is not supported, and of a GGUF repo download the .gguf file and pass its path)"
            )
        return snapshot

    def _weight_files(self, snapshot: Path) -> list[str]:
        """The shards the index names (a repo may also hold the same weights in another
        layout, e.g. consolidated.safetensors), else every top-level .safetensors."""
        index = snapshot / "model.safetensors.index.json"
        if not index.is_file():
            return ["*.safetensors"]
        try:
            return sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelLoadError(
                f"model {self.name!r}: model.safetensors.index.json has no readable weight_map "
                f"({type(exc).__name__}: {_first_line(exc)})"
            ) from None


def hub_error(model: HubModel, exc: Exception, cache_dir: str | None) -> ModelLoadError:
    """What went wrong fetching `model`, in one line that says what to do."""
    from huggingface_hub import constants, get_token
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    name, repo = repr(model.name), model.repo_id
    cache = cache_dir or constants.HF_HUB_CACHE
    pull = f"pull it where the Hub can be reached (pagedserve models pull {model.name})"
    if isinstance(exc, GatedRepoError):  # a RepositoryNotFoundError too: first
        page = f"{constants.ENDPOINT}/{repo}"
        if get_token() is None:
            return ModelLoadError(
                f"model {name} is gated on the Hugging Face Hub and no token was given: accept "
                f"its terms at {page} and set HF_TOKEN to a token of that account"
            )
        return ModelLoadError(
            f"model {name} is gated on the Hugging Face Hub and the token given (HF_TOKEN) has "
            f"no access to it: accept its terms at {page} with the token's account"
        )
    if isinstance(exc, RepositoryNotFoundError):
        return ModelLoadError(
            f"--model {repo!r} is not a local path, and the Hugging Face Hub has no model repo "
            f"{repo!r} (a private one needs HF_TOKEN set to a token that can read it)"
        )
    revision = model.revision or constants.DEFAULT_REVISION
    if isinstance(exc, RevisionNotFoundError):
        return ModelLoadError(
            f"model {repo!r} has no revision {revision!r} on the Hugging Face Hub: pass "
            f"an existing branch, tag or commit (--revision, or {repo}@<revision>)"
        )
    if isinstance(exc, IncompleteSnapshotError):  # a LocalEntryNotFoundError too: first
        return ModelLoadError(
            f"model {name} is only partly in the Hugging Face cache ({cache}) and the Hub "
            f"cannot be reached: {pull}"
        )
    if isinstance(exc, LocalEntryNotFoundError):
        if not constants.is_offline_mode():
            cause = exc.__cause__
            reason = f"{type(cause).__name__}: {_first_line(cause)}" if cause else "no answer"
            return ModelLoadError(
                f"model {name} is not in the Hugging Face cache ({cache}) and the Hub cannot "
                f"be reached ({reason}): check the network (or HF_ENDPOINT), or {pull}"
            )
        cached = _cached_refs(repo, cache)
        if cached is None:
            return ModelLoadError(
                f"model {name} is not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE is "
                f"set: {pull}, or unset HF_HUB_OFFLINE"
            )
        return ModelLoadError(
            f"model {repo!r} has no revision {revision!r} in the Hugging Face cache ({cache}; "
            f"cached: {', '.join(cached) or 'no branch or tag'}) and HF_HUB_OFFLINE is set: "
            f"{pull}, or unset HF_HUB_OFFLINE"
        )
    if isinstance(exc, HfHubHTTPError) and exc.response is not None:
        return ModelLoadError(
            f"model {name}: the Hugging Face Hub answered HTTP {exc.response.status_code} "
            f"({_first_line(exc)})"
        )
    if isinstance(exc, HFValidationError):
        return ModelLoadError(
            f"model {name} is not a valid repo id or revision: {_first_line(exc)}"
        )
    if isinstance(exc, OSError) and exc.strerror:  # the cache: permissions, a full disk
        where = f": {exc.filename}" if exc.filename else ""
        return ModelLoadError(f"model {name}: {exc.strerror}{where} (the cache is {cache})")
    return ModelLoadError(f"model {name}: {type(exc).__name__}: {_first_line(exc)}")


def _cached_refs(repo_id: str, cache: str) -> list[str] | None:
    """The branches and tags of `repo_id` in the cache; None if the repo is not there."""
    from huggingface_hub import CacheNotFound, scan_cache_dir

    try:
        info = scan_cache_dir(cache)
    except CacheNotFound:
        return None
    for repo in info.repos:
        if repo.repo_type == "model" and repo.repo_id == repo_id:
            return sorted(repo.refs)
    return None


def served_name(path: str | Path) -> str:
    """The name a server answers to: a hub cache snapshot's repo id (org/name), else the
    file or directory's own name."""
    path = Path(path)
    repo_folder = path.parent.parent.name  # models--org--name (a repo id has no "--")
    if path.parent.name == "snapshots" and repo_folder.startswith("models--"):
        return repo_folder.removeprefix("models--").replace("--", "/")
    return path.name


def _first_line(exc: BaseException) -> str:
    """An exception's message as one line: the CLI prints one line per error."""
    lines = str(exc).strip().splitlines()
    return lines[0].strip() if lines else type(exc).__name__
