"""Tensor parallelism (engine/distributed/): the plan codec round trip, sharding refused by
name, and two ranks on loopback (slow) — each run is tests/distributed_ranks.py under
`timeout` in its own process on fresh free ports, so a hung collective cannot hang the suite."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from distributed_ranks import BLOCK_SIZE, NUM_BLOCKS, generate

from engine.distributed.plan import (
    FRAME,
    HEADER,
    PlanError,
    decode,
    encode,
    encode_sleep,
    encode_stop,
)
from engine.distributed.shard import check_shardable
from engine.model_loader import load_model
from engine.model_runner import ModelRunner, pool_for
from engine.models import UnsupportedModelError, family_for
from engine.sampling import SamplingParams
from engine.scheduler import Phase, RowGroup
from engine.testing import FAMILY_CONFIGS, make_family_folder

RANKS = Path(__file__).parents[1] / "distributed_ranks.py"
# hidden 128, head_dim 32: o_proj and down_proj split over 2 ranks into whole 4-bit groups of 64
WIDER = {"hidden_size": 128, "head_dim": 32, "intermediate_size": 256}


def _fields(g: RowGroup) -> tuple:
    p = g.params
    params = None if p is None else (p.temperature, p.top_p, p.top_k, p.seed, p.logprobs,
                                     p.min_p)
    return (g.seq_id, g.token_ids, g.start, g.block_table, g.sample, g.output_index, g.trace,
            g.phase, g.state_slot, g.restore_from, g.snapshots, g.checkpoints, params)


GROUPS = [
    RowGroup("req-0", list(range(5, 45)), 0, [3, 4, 9], False),
    RowGroup("réq-1", [77], 40, [1, 2, 8], True,
             SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=2**40 + 3, logprobs=5,
                            min_p=0.05), output_index=12, trace=True),
    RowGroup("v", [1, 2, 3], 17, [0, 5], True, SamplingParams(), 3, phase=Phase.VERIFY,
             state_slot=4, restore_from=9, snapshots=[(0, 11), (1, 12)],
             checkpoints=[(16, 13)]),
]


def test_plan_round_trip():
    for path in ("gemm", "gemv", "tiled"):
        plan = decode(encode(GROUPS, path))
        assert not plan.stop and plan.path == path
        assert [_fields(g) for g in plan.groups] == [_fields(g) for g in GROUPS]
    stop, sleep = decode(encode_stop()), decode(encode_sleep())
    assert (stop.stop, stop.sleep, sleep.stop, sleep.sleep) == (True, False, False, True)
    assert sleep.nap_s == 0  # on the doorbell
    nap = decode(encode_sleep(20))  # ranks without a doorbell: nap, then the next broadcast
    assert nap.sleep and not nap.stop and nap.nap_s == 0.02
    assert decode(encode([])).groups == [] and not decode(encode([])).sleep


def test_launched_rank_and_the_hostfile_ports(tmp_path, monkeypatch):
    from engine.distributed.launch import DistributedError, hostfile_ports, launched_rank

    monkeypatch.delenv("MLX_RANK", raising=False)
    monkeypatch.setenv("MLX_HOSTFILE", "h.json")
    assert launched_rank() is None
    monkeypatch.setenv("MLX_RANK", "2")
    monkeypatch.delenv("MLX_HOSTFILE")
    with pytest.raises(DistributedError, match="ring backend only"):  # a JACCL launch, say
        launched_rank()
    monkeypatch.setenv("MLX_HOSTFILE", "h.json")
    assert launched_rank() == 2
    monkeypatch.setenv("MLX_RANK", "two")
    with pytest.raises(DistributedError, match="MLX_RANK must be an integer"):
        launched_rank()
    hosts = tmp_path / "hosts.json"
    hosts.write_text('[["10.0.0.1:5000", "10.0.0.1:5001"], ["10.0.0.2:5002"], "h:x"]')
    assert hostfile_ports(hosts) == [5000, 5002, 0]


def test_plan_longer_than_a_frame_and_refusals():
    long = [RowGroup(f"s{i}", list(range(600)), 0, list(range(40)), True) for i in range(3)]
    words = encode(long)
    assert len(words) > FRAME and words.dtype == np.int32
    assert [_fields(g) for g in decode(words).groups] == [_fields(g) for g in long]
    with pytest.raises(PlanError, match="malformed"):
        decode(words[:-5])  # shorter than its header says
    more = words.copy()
    more[3] += 1  # one group more than the payload holds
    with pytest.raises(PlanError, match="payload ends early"):
        decode(more)
    fewer = words.copy()
    fewer[3] -= 1
    with pytest.raises(PlanError, match="left over"):
        decode(fewer)
    with pytest.raises(PlanError, match="not a plan of this layout"):
        decode(np.zeros(HEADER, np.int32))
    with pytest.raises(PlanError, match="seed"):
        encode([RowGroup("x", [1], 0, [0], True, SamplingParams(seed=2**70))])
    with pytest.raises(PlanError, match="not a step's policy path"):
        encode(GROUPS, "native")


def test_single_rank_broadcast_is_the_plan():
    # A group of one rank (no MLX_HOSTFILE): the collectives return their input.
    from engine.distributed.plan import broadcast

    group = mx.distributed.init()
    if group.size() != 1:
        pytest.skip("this process already joined a group")
    words = encode(GROUPS)
    assert np.array_equal(broadcast(group, words), words)


def _folder(tmp_path: Path, name: str, quantize: bool, **overrides) -> Path:
    module_name, config = FAMILY_CONFIGS[name]
    module = importlib.import_module(f"mlx_lm.models.{module_name}")
    return make_family_folder(tmp_path / f"{name}-{quantize}", module,
                              {**config, **overrides}, quantize=quantize)


@pytest.mark.parametrize(("name", "size", "overrides", "why"), [
    ("gemma3_text", 2, {}, "supports llama, qwen2, qwen3, qwen3_moe, mixtral, gpt_oss only"),
    ("llama", 3, {}, "4 attention heads do not split over 3 ranks"),
    ("llama", 4, {}, "2 kv heads do not split over 4 ranks"),
    ("qwen3_moe", 2, {"moe_intermediate_size": 33},
     "33 expert intermediate size do not split over 2 ranks"),
    ("mixtral", 2, {"intermediate_size": 33},
     "33 expert intermediate size do not split over 2 ranks"),
    ("mixtral", 4, {}, "2 kv heads do not split over 4 ranks"),
    ("gpt_oss", 2, {"intermediate_size": 33},
     "33 expert intermediate size do not split over 2 ranks"),
    ("gpt_oss", 3, {}, "4 attention heads do not split over 3 ranks"),
])
def test_unshardable_refused_by_name(tmp_path, name, size, overrides, why):
    loaded = load_model(str(_folder(tmp_path, name, False, **overrides)), "f32")
    with pytest.raises(UnsupportedModelError, match=why):
        check_shardable(loaded.model, size, loaded.config)


def test_quantized_slice_of_partial_groups_refused(tmp_path):
    # head_dim 16: o_proj's 64 inputs over 2 ranks are 32, half a 4-bit group of 64
    loaded = load_model(str(_folder(tmp_path, "llama", True)), "q4")
    with pytest.raises(UnsupportedModelError, match="o_proj's 64 inputs over 2 ranks"):
        check_shardable(loaded.model, 2, loaded.config)


def test_quantized_expert_slice_of_partial_groups_refused(tmp_path):
    # moe_intermediate_size 64: each expert's down_proj inputs over 2 ranks are 32, half a
    # 4-bit group of 64 (head_dim 32: o_proj's 128 inputs split into whole groups)
    loaded = load_model(str(_folder(tmp_path, "qwen3_moe", True, head_dim=32)), "q4")
    with pytest.raises(UnsupportedModelError, match="down_proj's 64 inputs over 2 ranks"):
        check_shardable(loaded.model, 2, loaded.config)


def _ranks(*args: str, limit: int = 150) -> subprocess.CompletedProcess:
    return subprocess.run(["timeout", str(limit), sys.executable, str(RANKS), *args],
                          capture_output=True, text=True, timeout=limit + 30)


def _two_ranks_against_one(tmp_path, name: str, weights: str, kernels: str = "auto") -> None:
    """Two ranks over `name`'s tiny folder give one process's greedy ids, logprobs within
    1e-4, with attention and row kernels at `kernels` on every side."""
    # qwen3_moe: every expert's 128-wide intermediate split in two whole 4-bit groups (mixtral,
    # gpt_oss: WIDER's 256 is each expert's, 128 a rank)
    experts = {"moe_intermediate_size": 128} if name == "qwen3_moe" else {}
    folder = _folder(tmp_path, name, weights == "q4", **WIDER, **experts)
    out = tmp_path / "out.json"
    done = _ranks("run", str(folder), weights, str(out), kernels)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["exits"] == {"1": 0}
    layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    assert got["kv_heads"] == [1] * layers  # 2 kv heads, one per rank
    times = got["times"]
    assert len(times) == 7 and all(len(t["wall_s"]) == 2 for t in times)
    # The same steps in this process, unsharded.
    loaded = load_model(str(folder), weights)
    family = family_for(loaded.model, loaded.config)
    runner = ModelRunner(loaded.model, pool_for(family, NUM_BLOCKS, BLOCK_SIZE), kernels,
                         kernels, family=family)
    want = generate(runner.run)
    for seq_id, samples in want.items():
        tokens = got["tokens"][seq_id]
        assert [t for t, _ in tokens] == [t for t, _ in samples], seq_id
        np.testing.assert_allclose([lp for _, lp in tokens], [lp for _, lp in samples],
                                   atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["f32", "q4"])
@pytest.mark.parametrize("name", ["llama", "qwen3", "qwen3_moe", "mixtral", "gpt_oss"])
def test_two_ranks_generate_one_ranks_tokens(tmp_path, name, weights):
    _two_ranks_against_one(tmp_path, name, weights)


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["f32", "q4"])
@pytest.mark.parametrize("name", ["llama", "qwen3_moe"])
def test_two_ranks_on_mlx_ops_generate_one_ranks_tokens(tmp_path, name, weights):
    # What Metal and CUDA run: a row-sharded layer's slice through MLX's own matmul, then
    # the all_sum (engine/native_ops.py), and MLX's attention over the local heads.
    _two_ranks_against_one(tmp_path, name, weights, "mlx")


@pytest.mark.slow
def test_rank_that_never_starts_is_named(tmp_path):
    out = tmp_path / "out.json"
    done = _ranks("never-start", str(out), limit=60)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["error"] == "rank 1 did not start within 5 s"
    assert got["seconds"] < 15


@pytest.mark.slow
def test_rank_killed_mid_run_is_named(tmp_path):
    folder = _folder(tmp_path, "llama", False, **WIDER)
    out = tmp_path / "out.json"
    done = _ranks("kill", str(folder), "f32", str(out), limit=90)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["error"] == "rank 1 exited (signal SIGKILL): the step could not complete"
    assert len(got["times"]) == 1  # the first step ran; the second raised
