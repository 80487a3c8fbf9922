"""batchscope's inference engine: continuous batching over a paged KV cache, on MLX.

The optimized BLAS must be loaded before MLX is first imported (see platform.py), so it is done
here, before any submodule can import mlx; and TF32 is turned off before a GPU's first float32
matmul reads MLX's switch for it.
"""

from engine.platform import keep_float32_exact, preload_blas

preload_blas()
keep_float32_exact()
