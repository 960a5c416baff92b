"""Phi-3 and Phi-4 (Phi3ForCausalLM): the Llama decoder of engine/model/llama.py as it is.

The network is Llama's (RMSNorm, rotate-half rope, SiLU-gated MLP, no biases), except that
Phi-4-mini rotates only the first partial_rotary_factor of each head: the loader reorders
q and k rows so our whole-head rotation does that (engine/model/rope.py's rotary_order).
The checkpoint stores q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`, in the
order our merged parameters use ([q; k; v], [gate; up]), so they load whole (a
tensor-parallel rank reads each part's rows of its shard, engine/parallel/shard.py). The
config keeps original_max_position_embeddings at its top level for longrope, and
transformers reads the older rope types "su" and "yarn" of Phi-3 checkpoints as longrope.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.model.rope import rotary_order

ARCHITECTURE = "Phi3ForCausalLM"

# Architectures whose checkpoints already hold our merged projections.
FUSED_CHECKPOINTS = frozenset({ARCHITECTURE})


def phi3_rope(params: dict[str, Any], d: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's rope scaling as transformers reads it: "su" and "yarn" are longrope, and the
    original context comes from the top level when the scaling dict lacks it."""
    if params["rope_type"] in ("su", "yarn"):
        params["rope_type"] = "longrope"
    if params["rope_type"] == "longrope":
        params.setdefault(
            "original_max_position_embeddings", d.get("original_max_position_embeddings")
        )
    return params


def put_rotary_rows_in_order(
    weights: dict[str, torch.Tensor],
    head_dim: int,
    rotary_dim: int,
    num_heads: int,
    num_kv_heads: int,
) -> None:
    """Reorder each q and k head's rows of the merged qkv projection (weight and bias) by
    rotary_order, in place, so our whole-head rotation turns only the rotary part."""
    order = rotary_order(head_dim, rotary_dim)
    spans = ((0, num_heads), (num_heads * head_dim, num_kv_heads))  # q's heads, then k's
    for name, tensor in weights.items():
        if name.rsplit(".", 2)[-2] != "qkv_proj":
            continue
        for start, heads in spans:
            rows = tensor[start : start + heads * head_dim]
            heads_view = rows.view(heads, head_dim, *tensor.shape[1:])
            rows.copy_(heads_view[:, order.to(tensor.device)].reshape(rows.shape))
