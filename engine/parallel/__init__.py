"""Tensor parallelism: this process's place among the ranks that share a model (group.py)
and what of the model each rank holds (shard.py)."""
