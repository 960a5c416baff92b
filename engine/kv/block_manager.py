"""Paged-KV block bookkeeping: who owns which KV block, and which blocks can be reused.

Pure Python, no tensors: the KV pool lives with the model (layout in
engine/attention/base.py); this module only hands out block ids. Every block is in exactly
one of three states, so free + evictable + used == num_blocks:

    free       ref_count == 0, holds nothing worth keeping      -> the free list (FIFO)
    evictable  ref_count == 0, published in the prefix cache    -> the LRU (oldest evicted first)
    used       ref_count  > 0, held by one or more block tables

Free and evictable blocks can both be allocated; an evictable one (its cache entry dropped)
only once the free list is empty.

Prefix caching: a full block whose KV is computed is "registered" with the exact content it
holds (its tokens and the prefix before them) and "published" under a chain hash (of the
parent block's hash and its tokens), so a later prompt with the same prefix shares it
instead of recomputing. Hashes collide, so a hit is verified against the stored content. A
block's KV depends on every token before it, so the content names the parent prefix by a
`prefix_id`, which, unlike hashes (they collide) and block ids (recycled), is never reused.

With record_events, what publishes and evicts is also recorded as KV events
(engine/kv/events.py), for a router to follow; take_events hands them over.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

# The parent hash of a sequence's first block. hash(None) differs between processes (before
# Python 3.12), and a hash of ints does not: replicas then agree on every block's hash,
# which a router reading their KV events compares.
ROOT_HASH = 0


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Chain hash of a full block: the same in every process."""
    return hash((ROOT_HASH if parent_hash is None else parent_hash, token_ids))


@dataclass
class BlockTable:
    """One sequence's KV blocks, in token order."""

    block_ids: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0  # leading full blocks already registered in the prefix cache
    last_hash: int | None = None  # chain hash of block num_hashed_blocks - 1 (None before any)


@dataclass(frozen=True)
class BlockContent:
    """Exactly which KV a full, computed block holds."""

    block_hash: int
    token_ids: tuple[int, ...]
    prefix_id: int  # names the whole token prefix ending with this block
    parent_prefix_id: int | None  # None for the first block of a sequence


@dataclass
class Block:
    ref_count: int = 0
    content: BlockContent | None = None  # set once registered; cleared when the block is reused


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        record_events: bool = False,
    ):
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.queried_tokens = 0  # prompt tokens looked up with match_prefix
        self.hit_tokens = 0  # of those, tokens served from the cache
        self._blocks = [Block() for _ in range(num_blocks)]
        self._free_block_ids: deque[int] = deque(range(num_blocks))
        self._evictable_block_ids: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._cached_block_ids: dict[int, int] = {}  # chain hash -> published block id
        self._next_prefix_id = itertools.count()
        self.record_events = record_events and enable_prefix_caching
        self._events: list[KvEvent] = []

    def take_events(self) -> list[KvEvent]:
        """The KV events recorded since the last take, oldest first."""
        events, self._events = self._events, []
        return events

    # ---- capacity -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now: truly free plus cached-but-unreferenced (evictable)."""
        return len(self._free_block_ids) + len(self._evictable_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_needed(self, table: BlockTable, num_tokens: int) -> int:
        """Extra blocks `table` needs to hold `num_tokens` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(table.block_ids))

    # ---- the sequence lifecycle -------------------------------------------------------------

    def match_prefix(self, token_ids: Sequence[int]) -> tuple[BlockTable, int]:
        """Share the longest cached prefix of `token_ids`; return the new table and its length.
        Never the last token: its logits are needed, so it must be computed."""
        self.queried_tokens += len(token_ids)
        table = BlockTable()
        num_blocks = (len(token_ids) - 1) // self.block_size if self.enable_prefix_caching else 0
        while table.num_hashed_blocks < num_blocks:
            block_hash, chunk, parent_prefix_id = self._next_full_block(table, token_ids)
            if self._cached_content(block_hash, chunk, parent_prefix_id) is None:
                break
            block_id = self._cached_block_ids[block_hash]
            block = self._blocks[block_id]
            if block.ref_count == 0:
                del self._evictable_block_ids[block_id]  # revived from the cache
            block.ref_count += 1
            table.block_ids.append(block_id)
            table.num_hashed_blocks += 1
            table.last_hash = block_hash
        num_cached_tokens = len(table.block_ids) * self.block_size
        self.hit_tokens += num_cached_tokens
        return table, num_cached_tokens

    def allocate(self, table: BlockTable, num_tokens: int) -> bool:
        """Grow `table` to hold `num_tokens` tokens. All or nothing: False changes nothing."""
        num_needed = self.blocks_needed(table, num_tokens)
        if num_needed > self.num_free_blocks:
            return False
        evicted = []
        for _ in range(num_needed):
            if self._free_block_ids:
                block_id = self._free_block_ids.popleft()
            else:  # evict the least recently freed cached block
                block_id, _ = self._evictable_block_ids.popitem(last=False)
                block_hash = self._blocks[block_id].content.block_hash
                del self._cached_block_ids[block_hash]
                self._blocks[block_id].content = None
                evicted.append(block_hash)
            self._blocks[block_id].ref_count = 1
            table.block_ids.append(block_id)
        if evicted and self.record_events:
            self._events.append(BlockRemoved(tuple(evicted)))
        return True

    def register_full_blocks(
        self, table: BlockTable, token_ids: Sequence[int], num_computed_tokens: int
    ) -> None:
        """Publish every block that became full now that KV of `num_computed_tokens` exists."""
        if not self.enable_prefix_caching:
            return
        num_full_blocks = num_computed_tokens // self.block_size
        assert num_full_blocks <= len(table.block_ids) and num_computed_tokens <= len(token_ids)
        stored: list[tuple[int | None, int, tuple[int, ...]]] = []  # (parent hash, hash, tokens)
        while table.num_hashed_blocks < num_full_blocks:
            block_hash, chunk, parent_prefix_id = self._next_full_block(table, token_ids)
            block_id = table.block_ids[table.num_hashed_blocks]
            block = self._blocks[block_id]
            assert block.content is None, "registering a block twice"
            # An equal block already published makes ours a duplicate: it stays unpublished (as
            # does one whose hash collides with other content), but it names the same prefix,
            # so blocks after it chain on the cached one.
            cached = self._cached_content(block_hash, chunk, parent_prefix_id)
            prefix_id = cached.prefix_id if cached else next(self._next_prefix_id)
            block.content = BlockContent(block_hash, chunk, prefix_id, parent_prefix_id)
            if self._cached_block_ids.setdefault(block_hash, block_id) == block_id:
                stored.append((table.last_hash, block_hash, chunk))
            table.num_hashed_blocks += 1
            table.last_hash = block_hash
        if stored and self.record_events:
            self._record_stored(stored)

    def free(self, table: BlockTable) -> None:
        """Drop all the table's references, registered blocks included (tail first: see shrink)."""
        table.num_hashed_blocks, table.last_hash = 0, None
        self.shrink(table, 0)

    def shrink(self, table: BlockTable, num_tokens: int) -> None:
        """Drop the references past the first num_tokens tokens, tail first so that the tail
        is evicted first; never into registered blocks (tokens rolled back never were)."""
        keep = -(-num_tokens // self.block_size)
        assert keep >= table.num_hashed_blocks, "shrinking into registered blocks"
        for block_id in reversed(table.block_ids[keep:]):
            block = self._blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} freed more often than taken"
            block.ref_count -= 1
            if block.ref_count > 0:
                continue
            if self._is_published(block_id):
                self._evictable_block_ids[block_id] = None
            else:
                block.content = None
                self._free_block_ids.append(block_id)
        del table.block_ids[keep:]

    def reset(self) -> None:
        """Back to as built: every block free, the prefix cache empty, the stats zero. Only
        when no table holds a block (after a warm-up, say); the KV values stay, unread."""
        assert self.num_used_blocks == 0, f"{self.num_used_blocks} blocks are still held"
        # The Block objects stay: the engine froze them out of the collector's passes at
        # start-up, and new ones would be walked by every full collection again.
        for block_id in self._evictable_block_ids:  # only cached blocks keep content when free
            self._blocks[block_id].content = None
        self._free_block_ids = deque(range(self.num_blocks))
        self._evictable_block_ids.clear()
        self._cached_block_ids.clear()
        self._next_prefix_id = itertools.count()
        self.queried_tokens = self.hit_tokens = 0
        # What was recorded before is moot: a reader forgets this cache's blocks on this.
        self._events = [AllBlocksCleared()] if self.record_events else []

    # ---- internals --------------------------------------------------------------------------

    def _record_stored(self, stored: list[tuple[int | None, int, tuple[int, ...]]]) -> None:
        """One BlockStored per run of blocks that chain on each other (a block an equal
        cached one stood in for breaks a run: it was not published)."""
        runs: list[list[tuple[int | None, int, tuple[int, ...]]]] = []
        for block in stored:
            if runs and block[0] == runs[-1][-1][1]:
                runs[-1].append(block)
            else:
                runs.append([block])
        for run in runs:
            hashes = tuple(block_hash for _, block_hash, _ in run)
            tokens = tuple(token for _, _, chunk in run for token in chunk)
            self._events.append(BlockStored(hashes, run[0][0], tokens, self.block_size))

    def _next_full_block(
        self, table: BlockTable, token_ids: Sequence[int]
    ) -> tuple[int, tuple[int, ...], int | None]:
        """Chain hash, tokens and parent prefix id of the block after the table's hashed ones."""
        index = table.num_hashed_blocks
        chunk = tuple(token_ids[index * self.block_size : (index + 1) * self.block_size])
        parent = self._blocks[table.block_ids[index - 1]].content if index > 0 else None
        parent_prefix_id = parent.prefix_id if parent else None
        return hash_block(table.last_hash, chunk), chunk, parent_prefix_id

    def _cached_content(
        self, block_hash: int, token_ids: tuple[int, ...], parent_prefix_id: int | None
    ) -> BlockContent | None:
        """The published content under `block_hash` if it is exactly this KV (hashes collide)."""
        block_id = self._cached_block_ids.get(block_hash)
        if block_id is None:
            return None
        content = self._blocks[block_id].content
        same = content.token_ids == token_ids and content.parent_prefix_id == parent_prefix_id
        return content if same else None

    def _is_published(self, block_id: int) -> bool:
        content = self._blocks[block_id].content
        return content is not None and self._cached_block_ids.get(content.block_hash) == block_id
