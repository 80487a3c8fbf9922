"""batchscope's inference engine: continuous batching over a paged KV cache, on MLX.

The optimized BLAS must be loaded before MLX is first imported (see platform.py), so it is done
here, before any submodule can import mlx.
"""

from engine.platform import preload_blas

preload_blas()
