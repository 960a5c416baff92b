"""The Gemma 3 part of a model's config, read from a Hugging Face config.json (text only).

Gemma 3 interleaves sliding-window layers (rope base `rope_local_base_freq`, no scaling)
with global layers (`rope_theta` and any `rope_scaling`). transformers < 5 writes
`sliding_window_pattern` (layer i is global when (i + 1) is a multiple of it) and flat
rope keys; transformers >= 5 writes `layer_types` and `rope_parameters` per layer type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.errors import ModelLoadError

GEMMA3_ARCHITECTURE = "Gemma3ForCausalLM"
SLIDING, GLOBAL = "sliding_attention", "full_attention"
# Global-layer rope types we run exactly (engine/model/rope.py); local layers take none.
_GLOBAL_ROPE_TYPES = ("default", "linear")


@dataclass(frozen=True)
class Gemma3Config:
    layer_windows: tuple[int | None, ...]  # per layer: its sliding window, None = global
    local_rope_theta: float
    global_rope_theta: float
    global_rope_scaling: dict[str, Any] | None  # None = plain rope
    query_pre_attn_scalar: float  # attention scale = its inverse square root
    final_logit_softcapping: float | None

    @property
    def has_sliding_layers(self) -> bool:
        return any(window is not None for window in self.layer_windows)

    @classmethod
    def from_hf_config(cls, d: dict[str, Any], architecture: str) -> Gemma3Config | None:
        """None for any other architecture; one ModelLoadError line naming a field we
        cannot run exactly."""
        if architecture != GEMMA3_ARCHITECTURE:
            return None
        activation = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
        if activation != "gelu_pytorch_tanh":
            _unsupported("hidden_activation", activation, "'gelu_pytorch_tanh'")
        for key in ("attn_logit_softcapping", "use_bidirectional_attention", "attention_bias"):
            if d.get(key):  # attention soft-capping: no backend implements it
                _unsupported(key, d[key], "null or false")
        layer_types = _layer_types(d)
        window = d.get("sliding_window")
        if SLIDING in layer_types and not (isinstance(window, int) and window >= 1):
            _unsupported("sliding_window", window, "an integer >= 1")
        (global_theta, global_scaling), (local_theta, local_scaling) = _rope(d)
        if global_scaling is not None and global_scaling["rope_type"] not in _GLOBAL_ROPE_TYPES:
            _unsupported("rope_scaling", global_scaling["rope_type"], "'linear' or none")
        if local_scaling is not None:
            _unsupported("sliding_attention rope_type", local_scaling["rope_type"], "'default'")
        return cls(
            layer_windows=tuple(window if kind == SLIDING else None for kind in layer_types),
            local_rope_theta=local_theta,
            global_rope_theta=global_theta,
            global_rope_scaling=global_scaling,
            query_pre_attn_scalar=float(d.get("query_pre_attn_scalar", 256)),
            final_logit_softcapping=d.get("final_logit_softcapping"),
        )


def _layer_types(d: dict[str, Any]) -> list[str]:
    num_layers = d["num_hidden_layers"]
    layer_types = d.get("layer_types")
    if layer_types is None:
        pattern = d.get("sliding_window_pattern", d.get("_sliding_window_pattern", 6))
        layer_types = [GLOBAL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers)]
    if len(layer_types) != num_layers:
        _unsupported("layer_types", f"{len(layer_types)} entries", f"{num_layers}")
    for kind in layer_types:
        if kind not in (SLIDING, GLOBAL):
            _unsupported("layer_types", kind, f"{SLIDING!r} or {GLOBAL!r}")
    return list(layer_types)


RopeSetting = tuple[float, dict[str, Any] | None]  # (theta, scaling or None)


def _rope(d: dict[str, Any]) -> tuple[RopeSetting, RopeSetting]:
    """(global, local) rope settings from either layout."""
    per_type = d.get("rope_parameters")
    if per_type and GLOBAL in per_type:
        return _setting(per_type[GLOBAL], 1_000_000.0), _setting(per_type[SLIDING], 10_000.0)
    flat_global = dict(d.get("rope_scaling") or {})
    flat_global.setdefault("rope_theta", d.get("rope_theta", 1_000_000.0))
    local_theta = float(d.get("rope_local_base_freq", 10_000.0))
    return _setting(flat_global, 1_000_000.0), (local_theta, None)


def _setting(params: dict[str, Any] | None, default_theta: float) -> RopeSetting:
    params = dict(params or {})
    theta = float(params.pop("rope_theta", None) or default_theta)
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type == "default":
        return theta, None
    return theta, {"rope_type": rope_type, **params}


def _unsupported(key: str, value: Any, expected: str) -> None:
    raise ModelLoadError(f"unsupported Gemma 3 config value {key}={value!r} (expected {expected})")
