"""What the prefix cache tells the world: blocks published, blocks evicted, all dropped.

A router that sends each request to the replica already holding its prefix reads these
(llm-d's KV-cache indexer, the Shepherd Model Gateway). The block manager records them as
they happen; the server publishes them (service/kv_events.py). A block's hash is its chain
hash (block_manager.hash_block), the parent's the hash of the block before it in the
sequence, None for a sequence's first block.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockStored:
    """Consecutive full blocks of one sequence, now in the prefix cache."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]  # block_size tokens for each block, in order
    block_size: int


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks evicted from the prefix cache: their KV is gone."""

    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    """The prefix cache is empty (the engine reset it)."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared
