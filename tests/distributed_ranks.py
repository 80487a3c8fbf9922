"""Rank 0 of a tensor-parallel run on loopback, as a script tests start under `timeout`
(tests/engine/test_distributed.py): every collective runs in this child process, so a hang
cannot outlive the test.

    python tests/distributed_ranks.py run FOLDER WEIGHTS OUT.json   # generate through 2 ranks
    python tests/distributed_ranks.py run FOLDER WEIGHTS OUT.json mlx   # on MLX's own ops
    python tests/distributed_ranks.py kill FOLDER WEIGHTS OUT.json  # rank 1 killed after step 1
    python tests/distributed_ranks.py never-start OUT.json          # rank 1 never starts
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

NUM_BLOCKS, BLOCK_SIZE = 32, 16
PROMPTS = {"a": [(7 * j) % 300 + 5 for j in range(37)], "b": [(5 * j) % 200 + 9 for j in range(5)],
           "c": [(3 * j) % 250 + 2 for j in range(20)]}
DECODE_STEPS = 6


def generate(step, logprobs: int = 0) -> dict[str, list[tuple[int, float]]]:
    """Greedy generation of PROMPTS through `step(groups) -> StepOutput`: one prefill step of
    all three prompts, then DECODE_STEPS decode steps; seq_id -> [(token, logprob)]."""
    from engine.sampling import SamplingParams
    from engine.scheduler import RowGroup

    tables, at = {}, 0
    for seq_id, prompt in PROMPTS.items():
        n = -(-(len(prompt) + DECODE_STEPS + 1) // BLOCK_SIZE)
        tables[seq_id], at = list(range(at, at + n)), at + n
    params = SamplingParams(logprobs=logprobs)
    out = {seq_id: [] for seq_id in PROMPTS}
    groups = [RowGroup(s, p, 0, tables[s], True, params) for s, p in PROMPTS.items()]
    for i in range(DECODE_STEPS + 1):
        for seq_id, sampled in step(groups).sampled.items():
            s = sampled.samples[-1]
            out[seq_id].append((s.token_id, s.logprob))
        groups = [RowGroup(s, [out[s][-1][0]], len(p) + i, tables[s], True, params,
                           output_index=i + 1) for s, p in PROMPTS.items()]
    return out


def main(argv: list[str]) -> int:
    from engine.distributed.launch import DistributedError, start_ranks
    from engine.distributed.worker import Coordinator, sharded_runner, worker_args
    from engine.model_loader import load_model

    mode = argv[0]
    if mode == "never-start":
        t0 = time.monotonic()
        try:
            start_ranks(2, [sys.executable, "-c", "import time; time.sleep(120)"], timeout=5)
        except DistributedError as e:
            Path(argv[1]).write_text(json.dumps({"error": str(e),
                                                 "seconds": time.monotonic() - t0}))
            return 0
        return 1
    folder, weights, out_path = argv[1:4]
    # The kernels of every rank: "auto", or "mlx" (attention and row kernels on MLX's own ops,
    # as Metal and CUDA run them)
    kernels = argv[4] if len(argv) > 4 else "auto"
    settings = {"attention": kernels, "row_kernels": kernels}
    group, ranks = start_ranks(2, worker_args(folder, NUM_BLOCKS, BLOCK_SIZE, weights=weights,
                                              start_timeout=60, **settings), timeout=60)
    coordinator = Coordinator(group, sharded_runner(load_model(folder, weights), group,
                                                    NUM_BLOCKS, BLOCK_SIZE, **settings), ranks)
    times, steps = [], 0

    def step(groups):
        nonlocal steps
        if mode == "kill" and steps == 1:
            ranks.processes[1].kill()
            ranks.processes[1].wait()
        out, t = coordinator.step(groups)
        times.append(t.__dict__)
        steps += 1
        return out

    result: dict = {"kv_heads": coordinator.runner.pool.kv_heads}
    try:
        result["tokens"] = generate(step)
        result["exits"] = coordinator.stop()
    except DistributedError as e:
        result["error"] = str(e)
        ranks.stop(timeout=1)
    result["times"] = times
    Path(out_path).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
