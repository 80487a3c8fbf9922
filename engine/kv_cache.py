"""The paged KV pool: real storage for keys and values, addressed by block tables.

Per pool layer, keys and values live in one array of shape (kv_heads, num_blocks * block_size,
head_dim): slot = block_id * block_size + offset. Layers may differ in kv_heads and head_dim
(Gemma 4's sliding and global layers do), and a model whose layers share keys and values has
fewer pool layers than decoder layers (engine/models/ maps one to the other). Head-major, so
that a gathered context is already in the (kv_heads, ctx, head_dim) layout attention
multiplies with. A step writes its new rows with one scatter; the native attention kernel
reads the contexts in place through the block tables, other paths with one gather per layer.
The list holds the only reference to each array, so MLX can update it in place instead of
copying the pool.
"""

from __future__ import annotations

import mlx.core as mx

from engine.block_manager import KVCopy

# The fewest rows worth copying (KVPool.min_copy_rows) rather than computing again in the step,
# by how the pool copies. With MLX's ops a copy is a gather and a scatter per layer evaluated
# before the step, which cost about what computing 1-3 more rows in the step does and less from
# 4 rows on (docs/benchmarks.md, "A repeated prompt's tail": tails of 2-4 tokens 0.96-1.08x, a
# tail of 5, 4 rows copied, 1.20x shorter). The native op copies in place in a fraction of a
# millisecond: one row is worth copying (benchmarks/results/prefix_copy.md, which times both).
ROWS_WORTH_COPYING = 4
ROWS_WORTH_COPYING_NATIVE = 1

class KVPool:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int,
                 num_kv_heads: int | list[int], head_dim: int | list[int],
                 dtype: mx.Dtype | None = None):
        """num_kv_heads and head_dim: one number for every layer, or a list with one per layer.
        dtype: the storage (None: the dtype of the first keys written, the model's)."""
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv_heads = _per_layer(num_kv_heads, num_layers, "num_kv_heads")
        self.head_dims = _per_layer(head_dim, num_layers, "head_dim")
        # Allocated at the first write, in the dtype the model produces (matches mlx-lm's cache)
        # unless another was asked for.
        self.storage_dtype = dtype
        self._keys: list[mx.array] | None = None
        self._values: list[mx.array] | None = None
        # The native op that copies rows in place (engine/native/pool_copy.h), set by the
        # runner where its attention is native; None: MLX's gather and scatter.
        self.copy_op = None

    def reset(self) -> None:
        """Drop the storage (after an error left it unusable); reallocated at the next write."""
        self._keys = None
        self._values = None

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def dtype(self) -> mx.Dtype | None:
        return self._keys[0].dtype if self._keys else None

    def nbytes(self) -> int:
        if not self._keys:
            return 0
        return sum(k.nbytes + v.nbytes for k, v in zip(self._keys, self._values, strict=True))

    def _storage_for(self, model_dtype: mx.Dtype) -> mx.Dtype:
        dtype = self.storage_dtype or model_dtype
        if dtype.size > model_dtype.size:
            raise ValueError(f"a {dtype} KV cache is wider than the model's {model_dtype} "
                             "keys and values: use kv_dtype auto or a narrower one")
        return dtype

    def _allocate(self, dtype: mx.Dtype) -> None:
        shapes = [(kv, self.num_slots, dim) for kv, dim in zip(self.kv_heads, self.head_dims,
                                                              strict=True)]
        self._keys = [mx.zeros(shape, dtype=dtype) for shape in shapes]
        self._values = [mx.zeros(shape, dtype=dtype) for shape in shapes]
        mx.eval(self._keys, self._values)

    def write(self, layer: int, slots: mx.array, keys: mx.array, values: mx.array) -> None:
        """Store rows (rows, kv_heads, head_dim) at the given slots of one layer (rounded to the
        pool's dtype when it is narrower than the model's)."""
        if self._keys is None:
            self._allocate(self._storage_for(keys.dtype))
        dtype = self._keys[layer].dtype
        if keys.dtype != dtype:
            keys, values = keys.astype(dtype), values.astype(dtype)
        self._keys[layer][:, slots] = keys.swapaxes(0, 1)
        self._values[layer][:, slots] = values.swapaxes(0, 1)

    def writable(self, layer: int, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        """One layer's (keys, values) for an op that writes rows into them in place
        (engine/native/decoder_layer.h), the storage allocated at the first write as `write`
        does for a model computing in `dtype`."""
        if self._keys is None:
            self._allocate(self._storage_for(dtype))
        return self._keys[layer], self._values[layer]

    @property
    def min_copy_rows(self) -> int:
        """The fewest rows worth copying with this pool's copy_rows (BlockManager's
        min_copy_rows): fewer are computed again."""
        return ROWS_WORTH_COPYING if self.copy_op is None else ROWS_WORTH_COPYING_NATIVE

    def copy_rows(self, copies: list[KVCopy]) -> None:
        """Each copy's rows into its destination block, in every layer, evaluated now and on
        their own: left to the next step's graph, MLX's gathers and scatters made the step
        longer at 6 of 7 tail lengths, up to 1.30x (docs/benchmarks.md, "A repeated prompt's
        tail"). The native op (copy_op) copies every layer's rows in place, in one op."""
        bs = self.block_size
        pairs = [(c.source * bs + r, c.dest * bs + r) for c in copies for r in range(c.rows)]
        if self.copy_op is not None:
            mx.eval(self.copy_op(self.state(), pairs))
            return
        src = mx.array([p[0] for p in pairs])
        dst = mx.array([p[1] for p in pairs])
        for layer in range(len(self._keys)):
            self._keys[layer][:, dst] = self._keys[layer][:, src]
            self._values[layer][:, dst] = self._values[layer][:, src]
        mx.eval(self.state())

    def read(self, layer: int, slots: mx.array) -> tuple[mx.array, mx.array]:
        """Gather the keys and values at `slots` (in order) -> (kv_heads, len(slots), head_dim)."""
        return self._keys[layer][:, slots], self._values[layer][:, slots]

    def layer(self, layer: int) -> tuple[mx.array, mx.array]:
        """One layer's whole (keys, values) pool arrays, for kernels that read by block table."""
        return self._keys[layer], self._values[layer]

    def read_blocks(self, layer: int, block_ids: mx.array) -> tuple[mx.array, mx.array]:
        """Gather whole blocks (in order) -> (kv_heads, len(block_ids) * block_size, head_dim).

        Indexing blocks of block_size * head_dim contiguous values is faster than indexing the
        same slots one by one ("gather by block" against "gather by slot" at 4-16 decode rows
        in benchmarks/results/attention.md)."""
        kv, dim, bs = self.kv_heads[layer], self.head_dims[layer], self.block_size
        blocks = (kv, self.num_blocks, bs * dim)
        return (self._keys[layer].reshape(blocks)[:, block_ids].reshape(kv, -1, dim),
                self._values[layer].reshape(blocks)[:, block_ids].reshape(kv, -1, dim))

    def state(self) -> list[mx.array]:
        """Arrays to evaluate with a step, so the pool updates land before the next one."""
        return (self._keys or []) + (self._values or [])




def _per_layer(value: int | list[int], num_layers: int, name: str) -> list[int]:
    values = [value] * num_layers if isinstance(value, int) else list(value)
    if len(values) != num_layers or any(not isinstance(v, int) or v < 1 for v in values):
        raise ValueError(f"{name} must be a positive integer or one per layer ({num_layers})")
    return values
