"""Fused ops the model calls: Triton kernels on CUDA, plain torch everywhere else.

Each public op dispatches per call (dispatch.py): Triton when its tensors are on a CUDA
device and triton imports, the torch version otherwise. The torch versions are the CPU
path and the reference the Triton kernels are tested against (tests/test_kernels.py).
triton itself is imported only by triton_kernels.py, triton_linear.py (the skinny
GEMM engine/model/llama.py's linear() takes for decode batches) and triton_moe.py (the
grouped GEMM of fused_moe.py's experts), and only on the Triton path, so this package
imports on machines without CUDA or triton.
"""

from engine.kernels.activation import silu_and_mul
from engine.kernels.norm import fused_add_rms_norm, rms_norm
from engine.kernels.rotary import rotary_and_store_kv

__all__ = ["fused_add_rms_norm", "rms_norm", "rotary_and_store_kv", "silu_and_mul"]
