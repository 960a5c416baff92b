"""Integrity checks the tests run on the engine's bookkeeping."""

from __future__ import annotations

from engine.kv.block_manager import BlockManager


def check_invariants(manager: BlockManager) -> None:
    """Assert a block manager's bookkeeping is consistent: every block in exactly one of
    free / evictable / used, the LRU holding exactly the unused published blocks."""
    free = set(manager._free_block_ids)
    evictable = set(manager._evictable_block_ids)
    used = {i for i, block in enumerate(manager._blocks) if block.ref_count > 0}
    assert len(free) == len(manager._free_block_ids), "a block is on the free list twice"
    assert all(block.ref_count >= 0 for block in manager._blocks), "negative ref count"
    assert not free & used and not free & evictable and not evictable & used
    assert len(free) + len(evictable) + len(used) == manager.num_blocks, "a block is lost"
    assert len(used) == manager.num_used_blocks
    for block_hash, block_id in manager._cached_block_ids.items():
        content = manager._blocks[block_id].content
        assert content is not None and content.block_hash == block_hash
    published_unused = {
        i
        for i, block in enumerate(manager._blocks)
        if block.ref_count == 0 and manager._is_published(i)
    }
    assert evictable == published_unused, "the LRU must hold exactly the unused cached blocks"
    assert all(manager._blocks[i].content is None for i in free), "a free block kept its content"
