"""Native kernels: C++ MLX primitives built on this machine against the installed MLX.

`python -m engine.native.build` (run by scripts/setup.sh) compiles `_kernels`, which holds
the CPU ops for the rows of a step:

- `paged_attention`: attention for all of a step's rows (decode rows and prefill chunks) that
  reads keys and values straight from the paged pool, each row's bits its own;
- `decode_linear`: a float32 linear layer for the rows of a step, from weights packed once for
  it (`pack_linear_weight`: panels of 64 outputs, k-major), with a row's arithmetic independent
  of the others (batch-invariant) and of the instruction set;
- `decode_quantized_linear`: the same for MLX's affine-quantized (4/8-bit) layers, dequantizing
  each packed group once for all rows, the same bits on its AVX-512, AVX2 and portable paths;
- `rms_norm_rows` and `rope_rows`: RMS norm, and RoPE at each row's position, as one op each
  (MLX's CPU fallbacks build several, and on a few-row step dispatch dominates);
- `logsumexp_rows`: the sampled rows' log-normalizer, with mlx.core.logsumexp's bits, its exps
  vectorized;
- `greedy_rows`: greedy sampling's token and logprob per row, with the bits of the sampler's
  MLX ops (logsumexp, subtract, argmax, take) in one op;
- `quantized_embedding_rows`: MLX's affine-quantized embedding of a step's tokens as one op,
  with mlx.core.dequantize's bits (MLX's CPU dequantize builds ~40 ops);
- `decoder_layers`: consecutive llama-style decoder layers (the ops above, the KV write and
  the SwiGLU MLP of each) as one op, with the bits of those ops: one dispatch per step where
  there were ~25 per layer.
- `pool_copy_rows`: rows of the paged KV pool copied to other slots in place, every layer in
  one op (a prompt that matches part of a cached block gets those rows in a block of its own);
- `gated_delta_rows`: a Gated DeltaNet layer's conv and recurrence (Qwen3.5 / Qwen3-Next) on a
  step's float32 rows, each sequence's states read from and written to its pool slots.
- `read_bandwidth` and `time_quantized_linears`: measurements for the benchmarks, no part of
  a step (the memory the native threads read, the quantized kernel without MLX's dispatch).

When it is not built (no compiler, a build failure, or an MLX it was not built against), the
engine falls back to MLX ops and says so at start; nothing else changes.
"""

from __future__ import annotations

from collections.abc import Callable

_module = None
_why_not: str | None = None
_tried = False


def _load():
    global _module, _why_not, _tried
    if not _tried:
        _tried = True
        try:
            import mlx.core  # noqa: F401  (the extension links against MLX's library)

            from engine.native import _kernels
        except ImportError as error:
            _why_not = f"not built ({error}); run: python -m engine.native.build"
        else:
            _module = _kernels
    return _module


def paged_attention() -> Callable | None:
    """The native attention op, or None when it cannot be loaded here (see why_not())."""
    module = _load()
    return module.paged_attention if module else None


def decode_linear() -> Callable | None:
    """The native float32 linear op, or None when it cannot be loaded here. It takes x, the
    weight as pack_linear_weight() makes it, and the number of outputs."""
    module = _load()
    return module.decode_linear if module else None


def pack_linear_weight() -> Callable | None:
    """The op that packs a float32 (out, in) weight for decode_linear, or None when it cannot
    be loaded here."""
    module = _load()
    return module.pack_linear_weight if module else None


def decode_quantized_linear() -> Callable | None:
    """The native quantized (4/8-bit) decode linear op, or None when it cannot be loaded here."""
    module = _load()
    return module.decode_quantized_linear if module else None


def row_ops() -> tuple[Callable, Callable, Callable] | None:
    """(rms_norm_rows, rope_rows, logsumexp_rows), or None when they cannot be loaded here."""
    module = _load()
    return (module.rms_norm_rows, module.rope_rows, module.logsumexp_rows) if module else None


def greedy() -> Callable | None:
    """The native greedy-sampling op, or None when it cannot be loaded here."""
    module = _load()
    return module.greedy_rows if module else None


def quantized_embedding() -> Callable | None:
    """The native quantized embedding op, or None when it cannot be loaded here."""
    module = _load()
    return module.quantized_embedding_rows if module else None


def decoder_layers() -> Callable | None:
    """The fused op of consecutive decoder layers, or None when it cannot be loaded here."""
    module = _load()
    return module.decoder_layers if module else None


def pool_copy() -> Callable | None:
    """The native op that copies pool rows in place, or None when it cannot be loaded here."""
    module = _load()
    return module.pool_copy_rows if module else None


def gated_delta_rows() -> Callable | None:
    """The Gated DeltaNet recurrence op, or None when it cannot be loaded here."""
    module = _load()
    return module.gated_delta_rows if module else None


def layer_spec() -> type | None:
    """The fused layer's spec class (LayerSpec, with its LayerSpec.Linear and LayerSpec.Rope),
    or None when it cannot be loaded here."""
    module = _load()
    return module.LayerSpec if module else None


def kernel_timing() -> tuple[Callable, Callable] | None:
    """(read_bandwidth, time_quantized_linears): the benchmarks' measurements of the memory the
    native threads read and of the quantized kernel on its own; None when not built."""
    module = _load()
    return (module.read_bandwidth, module.time_quantized_linears) if module else None


def decode_quantized_fast() -> bool:
    """Whether the quantized op runs a vector path here (AVX-512 or AVX2). Its portable path is
    correct everywhere but slower than MLX's own quantized matmul at 1-16 rows (measured by
    benchmarks/decode_linear.py --weights q4 with BATCHSCOPE_QUANTIZED_ISA=portable on an
    x86-64 baseline build), so `auto` prefers MLX's."""
    return decode_quantized_isa() in ("avx512", "avx2")


def _required():
    """The built module, or RuntimeError saying why there is none."""
    module = _load()
    if module is None:
        raise RuntimeError(f"native kernels {why_not()}")
    return module


def decode_quantized_isa() -> str | None:
    """The instruction set the quantized op runs: "avx512", "avx2" or "portable" (the best this
    CPU has, which the module is built for, unless BATCHSCOPE_QUANTIZED_ISA names another);
    None when not built."""
    module = _load()
    return module.decode_quantized_isa() if module else None


def int8_activations_isa() -> str | None:
    """The path the quantized op's int8-activation option runs: "avx512-vnni" where the
    quantized op runs AVX-512 and the build has VNNI, else "portable" (the same bits, slower);
    None when not built."""
    module = _load()
    if module is None:
        return None
    vnni = module.quantized_int8_vnni_built() and module.decode_quantized_isa() == "avx512"
    return "avx512-vnni" if vnni else "portable"


def set_decode_quantized_isa(name: str) -> str:
    """Force the quantized op's path ("auto", "avx512", "avx2", "portable"; tests compare
    them): returns the one now in use, raises ValueError for one this CPU lacks."""
    return _required().set_decode_quantized_isa(name)


def set_attention_parallel_cost(cost: float) -> float:
    """The cost (keys x query heads / 16, summed over a call) from which the paged attention
    kernel shares a call with the worker threads: returns the one it replaces. For
    benchmarks/attention_threads.py, which measures the default; it changes no bit."""
    return _required().set_attention_parallel_cost(cost)


def attention_parallel_cost() -> float:
    """The cost set_attention_parallel_cost sets, as it is now (the kernel's default unless a
    benchmark changed it)."""
    return _required().attention_parallel_cost()


def threads() -> int | None:
    """Threads the native ops' pool uses (BATCHSCOPE_NATIVE_THREADS caps them); None when not
    built."""
    module = _load()
    return module.native_threads() if module else None


def why_not() -> str | None:
    """Why the native ops are unavailable, or None when they loaded."""
    _load()
    return _why_not
