"""Tensor parallelism over MLX's distributed group (docs/distributed.md): N ranks on this
machine over the ring backend (launch), the model sharded as mlx-lm shards it (shard), each
step's plan broadcast from rank 0 (plan) and run by every rank (worker)."""
