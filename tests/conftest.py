"""Shared fixtures: real model files, built or fetched by the code that needs them."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF), pulled once."""
    from engine.model_store import resolve_model

    return resolve_model(None)
