"""Paged attention on CUDA through flashinfer: prefills and eager decode steps.

Same contract and KV layout as the torch backend (engine/attention/base.py). The scheduler
puts decodes (one new token) first in the flat batch, then prefills and prefill chunks.
The leading run of one-token sequences goes to flashinfer's batch decode kernel; the rest
to its batch prefill kernel over the paged KV with causal=True, which serves a whole
prompt, a chunk of one and a prompt behind a prefix-cache hit alike: the new rows' K/V
are already in the pool (the model stores them as it rotates k), and query row j of a
sequence with q_len new tokens attends to keys [0, seq_len - q_len + j] (flashinfer
aligns the causal mask bottom-right).

plan() runs once per step on the host: it turns the step's sequence lengths into
flashinfer's CSR page tables (page_table below: indptr / last_page_len, and where in the
persistent block table each page's id is), gathers the page ids on the device and plans
both wrappers; each layer's forward() then only launches kernels. flashinfer takes a
sliding window and the softmax scale at plan time, so there is one set of wrappers per
window the model's layers have (Gemma 3: its sliding window and None), each planned every
step on the same page tables, and forward() runs the set of its layer's window. Decode
steps in CUDA graphs run engine/attention/triton_decode.py instead
(engine/attention/cuda.py picks).

An fp8 pool (engine/kv/fp8.py) is planned as such (kv_data_type), q staying in the model's
dtype; each layer's K and V scales go to run(), which folds the K scale into the softmax
scale and multiplies the output by the V scale.

flashinfer is imported only when the backend is configured, so this module imports (and
its planning math is tested) on machines without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engine.attention.base import AttentionMetadata, EagerOnly

# flashinfer's float workspace holds split-KV partial results; 128 MiB is its recommendation.
WORKSPACE_BYTES = 128 * 2**20
# Above this many query heads per KV head, decode always runs on the tensor-core (prefill)
# kernels: the CUDA-core decode kernel is only built for groups of 1-4, 6 and 8.
MAX_CUDA_CORE_GROUP = 4
# From this many sequences on, decode runs on the tensor-core kernels too. The CUDA-core
# kernel gives each (sequence, KV head) one thread block, so with uneven context lengths
# its longest sequences run on alone after the rest are done; the tensor-core path splits
# the KV into balanced chunks. Measured on the H200 at the offline workload's own decode
# steps (benchmarks/gpu_attention.py, benchmarks/RESULTS.md's git history): tensor cores
# 3.73-3.87 TB/s against 3.09-3.56 at 101-256 sequences; at 48 the CUDA-core kernel is 7%
# faster.
TENSOR_CORE_MIN_BATCH = 64


def decode_uses_tensor_cores(batch_size: int, group_size: int) -> bool:
    """Which flashinfer decode kernel a step of batch_size sequences runs."""
    return group_size > MAX_CUDA_CORE_GROUP or batch_size >= TENSOR_CORE_MIN_BATCH


def window_left(window: int | None) -> int:
    """flashinfer's form of a sliding window: a query at position p attends keys
    [p - window_left, p], so W keys is W - 1; -1 is no window."""
    return -1 if window is None else window - 1


@dataclass
class PageTable:
    """Some sequences' paged KV in flashinfer's CSR form, on the host."""

    indptr: np.ndarray  # int32 [B + 1]: sequence i's pages are pages [indptr[i], indptr[i + 1])
    # int64 [indptr[-1]]: where page p's block id sits in the flat block table
    # (slot * block_width + the page's number in the sequence)
    page_index: np.ndarray
    last_page_len: np.ndarray  # int32 [B]: tokens in each sequence's last page, 1..block_size


def page_table(
    seq_lens: Sequence[int], slots: Sequence[int], block_width: int, block_size: int
) -> PageTable:
    """The pages of sequences of seq_lens tokens whose blocks are rows `slots` of a block
    table block_width wide."""
    lens = np.asarray(seq_lens, dtype=np.int32)
    pages = (lens + block_size - 1) // block_size
    indptr = np.zeros(len(lens) + 1, dtype=np.int32)
    np.cumsum(pages, out=indptr[1:])
    row_starts = np.asarray(slots, dtype=np.int64) * block_width - indptr[:-1]
    page_index = np.repeat(row_starts, pages) + np.arange(int(indptr[-1]), dtype=np.int64)
    return PageTable(indptr, page_index, lens - (pages - 1) * block_size)


@dataclass
class StepPages:
    """One step's page tables, split into the decode run and the prefill rest.

    Both halves index one page list, so its ids are gathered in one go; the prefill
    half's indptr is relative to its own first page (decode_indptr[-1])."""

    num_decodes: int  # leading one-token sequences, which are also rows [0, num_decodes)
    page_index: np.ndarray  # int64: every sequence's pages, in batch order (PageTable)
    decode_indptr: np.ndarray  # int32 [D + 1]
    decode_last_page_len: np.ndarray  # int32 [D]
    prefill_qo_indptr: np.ndarray  # int32 [P + 1]: query rows, from row num_decodes
    prefill_indptr: np.ndarray  # int32 [P + 1], into the pages from decode_indptr[-1]
    prefill_last_page_len: np.ndarray  # int32 [P]

    @property
    def num_prefills(self) -> int:
        return len(self.prefill_last_page_len)


def split_step(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    slots: Sequence[int],
    block_width: int,
    block_size: int,
) -> StepPages:
    # The decode kernel takes the leading one-token sequences. A later one (a prompt whose
    # last token alone was left after a prefix hit) joins the prefills: their kernel
    # handles a query of any length, so the split is right whatever the order.
    query_lens = np.asarray(query_lens, dtype=np.int32)
    longer = np.flatnonzero(query_lens != 1)
    num_decodes = int(longer[0]) if len(longer) else len(query_lens)
    table = page_table(seq_lens, slots, block_width, block_size)
    prefill_indptr = table.indptr[num_decodes:] - table.indptr[num_decodes]
    qo_indptr = np.zeros(len(query_lens) - num_decodes + 1, dtype=np.int32)
    np.cumsum(query_lens[num_decodes:], out=qo_indptr[1:])
    return StepPages(
        num_decodes=num_decodes,
        page_index=table.page_index,
        decode_indptr=table.indptr[: num_decodes + 1],
        decode_last_page_len=table.last_page_len[:num_decodes],
        prefill_qo_indptr=qo_indptr,
        prefill_indptr=prefill_indptr,
        prefill_last_page_len=table.last_page_len[num_decodes:],
    )


class WindowWrappers:
    """flashinfer's wrappers for the layers of one sliding window (or of none)."""

    def __init__(
        self, flashinfer: Any, workspace: torch.Tensor, window: int | None, kinds: set[bool]
    ):
        self.window_left = window_left(window)
        # Eager decode wrappers by kernel (tensor cores or not, `kinds`), picked per step.
        self.eager_decode = {
            tensor_cores: flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                workspace, "NHD", use_tensor_cores=tensor_cores
            )
            for tensor_cores in kinds
        }
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        self.decode: Any = None  # the eager decode wrapper planned this step


class FlashInferAttention(EagerOnly):
    """Every step eagerly through flashinfer's wrappers. Build it, load the model with it,
    then configure()."""

    supports_sliding_window = True

    def __init__(self, device: torch.device):
        assert device.type == "cuda", device
        self.device = device

    def configure(
        self,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        scale: float | None = None,
        windows: Sequence[int | None] = (None,),
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        """Create the wrappers once the model's head shape, dtype, softmax scale and
        windows, and the KV pool's dtype, are known."""
        import flashinfer

        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.dtype = dtype
        self.kv_dtype = dtype if kv_dtype is None else kv_dtype
        # What the model passes to forward(); checked there, as the plans bake it in.
        self.scale = head_dim**-0.5 if scale is None else scale
        # "Must be initialized to 0 for its first use" (flashinfer); shared by every wrapper
        # of every window, which is safe because their kernels run one after another on one
        # stream: it holds a run's split-KV partials only while that run lasts. Each wrapper
        # keeps its plan in its own int workspace.
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        kinds = {self._tensor_cores(1), self._tensor_cores(TENSOR_CORE_MIN_BATCH)}
        self._wrappers = {
            window: WindowWrappers(flashinfer, self._workspace, window, kinds)
            for window in dict.fromkeys(windows)
        }
        # Rows [0, num_decode_rows) of this step run through a set's decode wrapper, the
        # rest through its prefill wrapper.
        self._num_decode_rows = 0
        # A wrapper's plan() stages its schedule in one pinned host buffer and copies it to
        # the device asynchronously; with the device running a step ahead (async
        # scheduling) the next plan must not overwrite that buffer before the copy ran.
        self._plan_copied = torch.cuda.Event()

    # ---- per step, on the host ----------------------------------------------------------

    def plan(self, meta: AttentionMetadata) -> None:
        self._plan_copied.synchronize()  # at once, but for a plan still queued behind a step
        pages = split_step(
            meta.query_lens,
            meta.seq_lens,
            meta.slots,
            meta.block_table.shape[1],
            meta.block_size,
        )
        page_index = _pinned(pages.page_index).to(self.device, non_blocking=True)
        indices_gpu = meta.block_table.view(-1)[page_index]
        self._num_decode_rows = pages.num_decodes
        tensor_cores = self._tensor_cores(pages.num_decodes)
        for wrappers in self._wrappers.values():
            wrappers.decode = wrappers.eager_decode[tensor_cores]
        if pages.num_decodes:
            indptr = _pinned(pages.decode_indptr)
            last_page_len = _pinned(pages.decode_last_page_len)
            for wrappers in self._wrappers.values():
                self._plan_decode(
                    wrappers.decode,
                    indptr,
                    indices_gpu,
                    last_page_len,
                    meta.block_size,
                    wrappers.window_left,
                )
        if pages.num_prefills:
            first_page = int(pages.decode_indptr[-1])
            qo_indptr = _pinned(pages.prefill_qo_indptr)
            indptr = _pinned(pages.prefill_indptr)
            last_page_len = _pinned(pages.prefill_last_page_len)
            for wrappers in self._wrappers.values():
                wrappers.prefill.plan(
                    qo_indptr,
                    indptr,
                    indices_gpu[first_page:],
                    last_page_len,
                    self.num_qo_heads,
                    self.num_kv_heads,
                    self.head_dim,
                    meta.block_size,
                    causal=True,
                    window_left=wrappers.window_left,
                    sm_scale=self.scale,
                    q_data_type=self.dtype,
                    kv_data_type=self.kv_dtype,
                    non_blocking=True,
                )
        self._plan_copied.record()

    def _tensor_cores(self, batch_size: int) -> bool:
        return decode_uses_tensor_cores(batch_size, self.num_qo_heads // self.num_kv_heads)

    def _plan_decode(
        self,
        wrapper: Any,
        indptr: torch.Tensor,  # pinned host memory, as is last_page_len
        indices: torch.Tensor,  # on the device
        last_page_len: torch.Tensor,
        block_size: int,
        window_left: int,
    ) -> None:
        # plan() reads indptr and last_page_len on the host and copies them to the device
        # itself (asynchronously, as they are pinned).
        wrapper.plan(
            indptr,
            indices,
            last_page_len,
            self.num_qo_heads,
            self.num_kv_heads,
            self.head_dim,
            block_size,
            window_left=window_left,
            sm_scale=self.scale,
            q_data_type=self.dtype,
            kv_data_type=self.kv_dtype,
            non_blocking=True,
        )

    # ---- per layer, kernels only ---------------------------------------------------------

    def forward(
        self,
        q: torch.Tensor,  # [T, num_q_heads, head_dim]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        assert scale == self.scale, "flashinfer was planned with the model's softmax scale"
        wrappers = self._wrappers[window]  # planned for each window configure() was given
        rows = self._num_decode_rows
        # None where 1.0: run() multiplies its output by a V scale in a kernel of its own.
        scales = {
            "k_scale": None if k_scale == 1.0 else k_scale,
            "v_scale": None if v_scale == 1.0 else v_scale,
        }
        if rows == q.shape[0]:
            return wrappers.decode.run(q, kv_cache, **scales)
        out = torch.empty_like(q)
        if rows:
            wrappers.decode.run(q[:rows], kv_cache, out=out[:rows], **scales)
        wrappers.prefill.run(q[rows:], kv_cache, out=out[rows:], **scales)
        return out


def _pinned(array: np.ndarray) -> torch.Tensor:
    """A host tensor in page-locked memory, so a non_blocking copy of it is asynchronous."""
    return torch.from_numpy(array).pin_memory()
