"""One directory for the kernels Triton and flashinfer build, shared by every start.

Triton keeps compiled kernels under $TRITON_CACHE_DIR, flashinfer its JIT-built modules
under $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer. flashinfer reads its variable once,
when it is first imported (flashinfer/jit/env.py), and a JITFunction reads Triton's when
it first compiles, so apply_kernel_cache_dir() must run in the process that builds the
engine (the engine's child process too) before either is imported: LLMEngine calls it
first thing, and nothing in engine/ imports them at module level.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)

TRITON_ENV = "TRITON_CACHE_DIR"
FLASHINFER_ENV = "FLASHINFER_WORKSPACE_BASE"


def kernel_cache_env(directory: str | os.PathLike) -> dict[str, str]:
    """The environment that points both compilers at `directory`."""
    base = Path(directory).expanduser().resolve()
    return {TRITON_ENV: str(base / "triton"), FLASHINFER_ENV: str(base)}


def apply_kernel_cache_dir(directory: str | os.PathLike | None) -> None:
    """Point Triton's and flashinfer's caches at `directory` (None: leave them be)."""
    if directory is None:
        return
    env = kernel_cache_env(directory)
    for path in env.values():
        Path(path).mkdir(parents=True, exist_ok=True)
    if "flashinfer" in sys.modules and os.environ.get(FLASHINFER_ENV) != env[FLASHINFER_ENV]:
        log.warning(
            "flashinfer was imported before kernel_cache_dir was applied: it keeps the "
            "workspace it read then (%s)",
            os.environ.get(FLASHINFER_ENV, "the home directory"),
        )
    os.environ.update(env)
    log.info("kernel cache: %s (Triton %s)", env[FLASHINFER_ENV], env[TRITON_ENV])
