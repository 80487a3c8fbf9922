"""Engine configuration: one dataclass, checked at construction, and the kernel-path policy
(engine/kernels.py runs the paths). Imports no MLX, so the command line can read it cheaply."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from engine.speculative import SpeculativeConfig


class ValueEnum(enum.StrEnum):
    """A string enum whose members read as their values everywhere, repr included: they
    compare, hash, format and serialize (JSON, the database) as the plain strings do."""

    def __repr__(self) -> str:
        return repr(self.value)


class KernelPath(ValueEnum):
    """How a step's linear layers run over its rows (engine/kernels.py). A policy picks gemm,
    gemv or tiled for a step; the step records native instead where every one of its matmul
    calls ran on a native row kernel (engine/kernels.py, PathTally)."""

    GEMM = "gemm"  # one batched call per linear layer over all of the step's rows
    GEMV = "gemv"  # one call per row
    TILED = "tiled"  # the batch-invariant path: every call has exactly `tile` rows
    NATIVE = "native"  # every call the native kernels: each row computed alone, in a fixed order


POLICIES = ("gemm", "gemv", "auto")
DEFAULT_TILE = 16  # rows per call on the tiled path (--invariant-tile)


@dataclass(frozen=True)
class KernelPolicy:
    mode: str = "gemm"
    threshold: int = 1  # for "auto": row-wise at or below this many rows

    def __post_init__(self) -> None:
        if self.mode not in POLICIES:
            raise ValueError(f"kernel policy must be one of {', '.join(POLICIES)}, "
                             f"got {self.mode!r}")
        if not isinstance(self.threshold, int) or self.threshold < 0:
            raise ValueError(f"kernel threshold must be a non-negative integer, "
                             f"got {self.threshold!r}")

    def path_for(self, rows: int) -> KernelPath:
        if self.mode == "auto":
            return KernelPath.GEMV if rows <= self.threshold else KernelPath.GEMM
        return KernelPath(self.mode)

    def describe(self) -> str:
        return f"auto(T={self.threshold})" if self.mode == "auto" else self.mode


WEIGHT_FORMATS = ("auto", "q4", "f32", "bf16")
# The KV pool's storage: "auto" is the dtype the model computes in (what mlx-lm's cache holds);
# a narrower one halves the bytes attention reads per position and doubles the positions a
# pool of a given size holds (docs/engine.md, "KV dtype").
KV_DTYPES = ("auto", "float32", "float16", "bfloat16")
# What the affine-quantized linear layers multiply their weights with: the float32 activations
# (mlx-lm's numbers), or the activations quantized to 8 bits per row in blocks of 32 with
# integer dot products (engine/native/quantized_int8.cpp: faster, and not mlx-lm's numbers;
# the divergence view shows where they part).
ACTIVATIONS = ("float32", "int8")


class NativeSetting(ValueEnum):
    """The native-kernel settings: attention (engine/attention.py) and row_kernels
    (engine/native_ops.py: everything a step computes per row outside attention, i.e. the
    float32 and affine 4/8-bit linear layers, RMS norm, RoPE, the sampler's logsumexp and the
    fused decoder layer)."""

    AUTO = "auto"  # the native op on the CPU backend when it is built, else MLX's own
    NATIVE = "native"  # requires the native op
    MLX = "mlx"  # never uses it


NATIVE_SETTING = tuple(NativeSetting)


def check_native_setting(name: str, value: str) -> None:
    if value not in NATIVE_SETTING:
        raise ValueError(f"{name} must be one of {', '.join(NATIVE_SETTING)}, got {value!r}")


def check_activations(value: str) -> None:
    if value not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {value!r}")


@dataclass
class EngineConfig:
    model: str = "embedded"  # "embedded" or a local mlx-lm model folder
    weights: str = "auto"
    kv_dtype: str = "auto"
    max_num_seqs: int = 16  # requests that may share one step
    # Rows (token positions) one step may hold: a long prompt's prefill chunk. Decode rows go
    # first, so a chunk is how long running streams wait for their next token while a prompt
    # prefills: in benchmarks/results/chunk_size.md (benchmarks/chunk_size.py) a 4096-token
    # prompt's TTFT is about the same with chunks of 128 to 2048 rows, and 4 streams' longest
    # wait grows with the chunk.
    max_num_batched_tokens: int = 256
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int = 1024  # blocks in the pool (x block_size = KV capacity in tokens)
    enable_prefix_caching: bool = True
    max_model_len: int | None = None  # defaults to the model's context length
    step_history: int = 2048  # step records kept in the ring buffer
    kernel_policy: str = "gemm"  # "gemm", "gemv" or "auto" (see engine/kernels.py)
    # For "auto": row-wise at or below this many rows in a step. None: the calibrated value for
    # this model, weights and backend (batchscope calibrate), else 1.
    kernel_threshold: int | None = None
    # A request's output must not depend on what shares its batch: every linear call gets
    # exactly `invariant_tile` rows (padded), whatever the step holds. Overrides kernel_policy.
    batch_invariant: bool = False
    invariant_tile: int = DEFAULT_TILE
    attention: str = NativeSetting.AUTO
    row_kernels: str = NativeSetting.AUTO
    activations: str = "float32"  # ACTIVATIONS
    # Speculative decoding (engine/speculative.py): "off", "ngram" (prompt lookup) or "draft"
    # (a draft model, engine/draft.py); drafts per request per step; the n-gram sizes matched;
    # the most running requests at which a step still speculates; and the draft model:
    # "layers:N" (the target's first N layers), "embedded" or a local mlx-lm folder.
    speculative: str = "off"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    speculative_max_batch: int = 4
    draft_model: str | None = None
    # Models with recurrent layers (Gated DeltaNet, engine/state_slots.py): slots for running
    # sequences (None: max_num_seqs); a prefix checkpoint of the state every this many tokens
    # (a multiple of block_size); and the memory the checkpoints may take.
    state_slots: int | None = None
    state_checkpoint_interval: int = 256
    state_checkpoint_mib: int = 256
    # Async scheduling (engine/lookahead.py): a step of plain decode rows has the next one
    # built and queued while it computes, fed its sampled tokens as they are computed.
    async_scheduling: bool = True
    # Ranks on this machine that each hold a shard of the model (engine/distributed/): rank 0
    # runs the scheduler and sends each step's plan to the others. 1: this process alone.
    tensor_parallel_size: int = 1
    # Each step's all_sums timed on every rank (RankTimes.all_sum_s, engine/collectives.py).
    # Off by default: it cuts the step's graph at each all_sum, a cost engine/collectives.py
    # describes.
    time_collectives: bool = False

    def __post_init__(self) -> None:
        if self.weights not in WEIGHT_FORMATS:
            raise ValueError(
                f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {self.weights!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(
                f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_kv_blocks",
                     "step_history", "invariant_tile", "tensor_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        check_native_setting("attention", self.attention)
        check_native_setting("row_kernels", self.row_kernels)
        check_activations(self.activations)
        threshold = 1 if self.kernel_threshold is None else self.kernel_threshold
        KernelPolicy(self.kernel_policy, threshold)  # raises on bad values
        _ = self.speculation  # raises on bad values
        if self.state_slots is not None and (not isinstance(self.state_slots, int)
                                             or self.state_slots < 1):
            raise ValueError(f"state_slots must be a positive integer, got {self.state_slots!r}")
        interval = self.state_checkpoint_interval
        if not isinstance(interval, int) or interval < 1 or interval % self.block_size:
            raise ValueError(f"state_checkpoint_interval must be a positive multiple of "
                             f"block_size ({self.block_size}), got {interval!r}")
        if not isinstance(self.state_checkpoint_mib, int) or self.state_checkpoint_mib < 0:
            raise ValueError("state_checkpoint_mib must be a non-negative integer, got "
                             f"{self.state_checkpoint_mib!r}")
        if self.tensor_parallel_size > 1 and self.speculative == "draft":
            # The draft model would run on rank 0 alone, over layers the ranks shard.
            raise ValueError("speculative draft is not supported with tensor_parallel_size > 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len!r}")

    @property
    def speculation(self) -> SpeculativeConfig:
        return SpeculativeConfig(self.speculative, self.num_speculative_tokens,
                                 self.prompt_lookup_min, self.prompt_lookup_max,
                                 self.speculative_max_batch, self.draft_model)
