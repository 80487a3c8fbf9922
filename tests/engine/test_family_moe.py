"""qwen3_moe and mixtral against mlx-lm's own generation on tiny folders, and the expert load
the engine records against the router's choice recomputed by mlx-lm's own model."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import mixtral, qwen3_moe

from engine.testing import FAMILY_CONFIGS
from tests.family_models import (
    check_batch_equals_alone,
    check_cli_equals_mlx_lm,
    embedded_tokenizer,
    make_folder,
)

pytestmark = pytest.mark.slow

CONFIGS = {name: (qwen3_moe if name == "qwen3_moe" else mixtral, FAMILY_CONFIGS[name][1])
           for name in ("qwen3_moe", "mixtral")}
MOE_LAYERS = {"qwen3_moe": [0, 2], "mixtral": [0, 1]}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def family(request, tmp_path_factory):
    module, config = CONFIGS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    return (request.param, make_folder(root / "f32", module, config),
            make_folder(root / "q4", module, config, quantize=True))


def test_greedy_equals_mlx_lm_f32(family):
    check_cli_equals_mlx_lm(family[1], "f32")


def test_greedy_equals_mlx_lm_q4(family):
    check_cli_equals_mlx_lm(family[2], "q4")


def test_q4_folder_loaded_as_f32_is_dense(family):
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    from engine.model_loader import load_folder

    loaded = load_folder(family[2], "f32")
    modules = [m for _, m in loaded.model.named_modules()]
    assert loaded.weights == "f32"
    assert not any(isinstance(m, nn.QuantizedLinear | QuantizedSwitchLinear) for m in modules)
    assert sum(type(m) is SwitchLinear for m in modules) == 3 * len(MOE_LAYERS[family[0]])
    assert load_folder(family[2], "q4").weights == "q4"


def test_batched_equals_alone_q4(family):
    check_batch_equals_alone(family[2], "q4", long_prompt_tokens=90)


def test_batched_equals_alone_f32_batch_invariant(family):
    check_batch_equals_alone(family[1], "f32", long_prompt_tokens=90, batch_invariant=True)


# ---- the expert load in the step records ------------------------------------------------------
class _Capture(nn.Module):
    """Stands in for an MoE block's switch_mlp: records the indices mlx-lm's router chose."""

    def __init__(self, inner: nn.Module, into: list):
        super().__init__()
        self.inner = inner
        self._into = into

    def __call__(self, x, indices):
        self._into.append(indices)
        return self.inner(x, indices)


def router_choices(folder: Path, ids: list[int]) -> dict[int, np.ndarray]:
    """mlx-lm's own model over the whole sequence (one forward, no cache): per MoE layer, the
    experts its router chose at each position, (positions, k)."""
    from mlx_lm import load

    model, _ = load(str(folder))
    captured: dict[int, list] = {}
    for i, layer in enumerate(model.model.layers):
        block = getattr(layer, "block_sparse_moe", None) or layer.mlp
        if hasattr(block, "switch_mlp"):
            captured[i] = []
            block.switch_mlp = _Capture(block.switch_mlp, captured[i])
    mx.eval(model(mx.array(ids)[None]))
    return {i: np.array(got[0][0]) for i, got in captured.items()}


def test_step_records_count_the_routers_choice(family):
    """Every step's expert_rows equal, layer by layer, the experts mlx-lm's router picks for
    the positions that step computed (entries: rows ending at context_len)."""
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.sampling import SamplingParams

    name, folder = family[0], family[1]
    config = CONFIGS[name][1]
    experts, k = config.get("num_experts", config.get("num_local_experts")), 2
    tokenizer = embedded_tokenizer()
    base = tokenizer.encode(" ".join(f"word{i} is number {i}." for i in range(60)))
    prompts = {f"r{n}": base[n:n + length] for n, length in enumerate([40, 7, 23, 70])}
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    with Engine(EngineConfig(model=str(folder), weights="f32", max_num_batched_tokens=48,
                             num_kv_blocks=64, block_size=16)) as engine:
        handles = [engine.submit(p, params, request_id=r) for r, p in prompts.items()]
        outputs = {h.request_id: h.result().token_ids for h in handles}
        records = engine.steps.recent()
    # The positions each request fed: its prompt and every output token but the last.
    chosen = {r: router_choices(folder, prompts[r] + outputs[r][:-1]) for r in prompts}
    assert sorted(chosen["r0"]) == MOE_LAYERS[name]
    mixed = 0
    for record in records:
        assert sorted(record.expert_rows) == [str(i) for i in MOE_LAYERS[name]]
        mixed += len({e.phase for e in record.entries}) > 1
        for layer in MOE_LAYERS[name]:
            expected = np.zeros(experts, dtype=int)
            for e in record.entries:
                picks = chosen[e.request_id][layer][e.context_len - e.rows:e.context_len]
                expected += np.bincount(picks.reshape(-1), minlength=experts)
            assert record.expert_rows[str(layer)] == expected.tolist(), (record.step, layer)
            assert sum(record.expert_rows[str(layer)]) == k * record.total_rows
    assert mixed, "no step mixed prefill and decode rows"
    # The experts are MLX's gather calls: a step with them is never recorded native.
    assert {r.kernel_path for r in records} == {"gemm"}
