"""Llama-family decoders and the loaders that build them from HF directories or GGUF files."""

from engine.model.config import ModelConfig
from engine.model.loader import load_model

__all__ = ["ModelConfig", "load_model"]
