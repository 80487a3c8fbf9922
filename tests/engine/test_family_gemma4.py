"""gemma4_text against mlx-lm's own generation on tiny folders: sliding and full layers of other
head sizes and kv head counts, partial (proportional) RoPE on the full layers, KV-shared
layers, per-layer inputs, double-wide MLPs, soft-capped logits; and a routed-experts model
with attention_k_eq_v."""

from __future__ import annotations

import pytest
from mlx_lm.models import gemma4_text

from engine.model_runner import pool_for
from engine.models import UnsupportedModelError, family_for
from engine.testing import FAMILY_CONFIGS
from tests.family_models import (
    check_batch_equals_alone,
    check_cli_equals_mlx_lm,
    make_folder,
)

pytestmark = pytest.mark.slow

S, F = "sliding_attention", "full_attention"
CONFIGS = {"dense": FAMILY_CONFIGS["gemma4_text"][1],
           "moe": FAMILY_CONFIGS["gemma4_text-moe"][1]}
ROPE = CONFIGS["dense"]["rope_parameters"]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def gemma4(request, tmp_path_factory):
    config = CONFIGS[request.param]
    root = tmp_path_factory.mktemp(f"gemma4-{request.param}")
    return (config, make_folder(root / "f32", gemma4_text, config),
            make_folder(root / "q4", gemma4_text, config, quantize=True))


def test_kv_shared_layers_read_mlx_lm_sources_and_the_pool_is_smaller(gemma4):
    config, folder, _ = gemma4
    from mlx_lm import load

    model, _ = load(str(folder))
    family = family_for(model)
    kvs = family.layer_kv()
    n = config["num_hidden_layers"]
    first_shared = n - config["num_kv_shared_layers"]
    writers = [i for i, kv in enumerate(kvs) if kv.writes]
    assert writers == list(range(first_shared))
    for i, kv in enumerate(kvs):
        # The source is the last non-shared layer of the same kind, as in mlx-lm.
        src = max(j for j in range(min(i + 1, first_shared))
                  if config["layer_types"][j] == config["layer_types"][i])
        assert src == model.model.previous_kvs[i]
        assert kv.pool_layer == writers.index(src)
        assert kv.window == (16 if config["layer_types"][i] == S else None)
    pool = pool_for(family, 8, 16)
    assert pool.num_layers == first_shared < n
    assert set(pool.head_dims) == {16, 32}
    if config.get("attention_k_eq_v"):
        assert set(pool.kv_heads) == {1, 2}


def test_greedy_equals_mlx_lm_f32(gemma4):
    """Ids and logprobs: greedy ids cannot see the soft-cap (tanh keeps the order), the
    logprobs do."""
    check_cli_equals_mlx_lm(gemma4[1], "f32")


def test_greedy_equals_mlx_lm_q4(gemma4):
    check_cli_equals_mlx_lm(gemma4[2], "q4")


def test_tied_head_equals_mlx_lm_f32(tmp_path):
    """With a tied head these random models repeat one token, so 8 tokens say as much as 32."""
    config = {**CONFIGS["dense"], "tie_word_embeddings": True}
    check_cli_equals_mlx_lm(make_folder(tmp_path / "tied", gemma4_text, config), "f32", 8)


def test_batched_equals_alone_q4(gemma4):
    check_batch_equals_alone(gemma4[2], "q4", long_prompt_tokens=90)


def test_traces_pad_pool_layers_of_other_shapes(gemma4):
    from app.lab.divergence import SideConfig, run_experiment
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.sampling import SamplingParams

    config, folder, _ = gemma4
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    with Engine(EngineConfig(model=str(folder), weights="f32", num_kv_blocks=16)) as engine:
        finish = engine.submit(list(range(100, 120)), params, trace=True).result()
    first = finish.trace[0]["kv"]
    heads = 1 if config.get("attention_k_eq_v") else 2
    # (pool layers, keys/values, widest kv_heads, rows, widest head_dim)
    assert first.shape == (config["num_hidden_layers"] - 2, 2, 2, 20, 32)
    full = config["layer_types"].index(F)
    sliding = config["layer_types"].index(S)
    assert (first[sliding, :, :, :, 16:] == 0).all() and (first[sliding, :, :, :, :16] != 0).any()
    assert (first[full, :, heads:] == 0).all() and (first[full, :, :heads] != 0).any()
    # The divergence view reads those traces: the same side twice compares bit-identical.
    side = SideConfig(weights="f32", alongside=(30,), join_at=1)
    record = run_experiment(list(range(100, 120)), side, side, max_tokens=4, model=str(folder))
    assert record.bit_identical and record.kv.compared_positions == 23


def test_rope_that_cannot_take_per_row_positions_is_refused():
    rope = {**ROPE, S: {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}
    args = gemma4_text.ModelArgs.from_dict({**CONFIGS["moe"], "rope_parameters": rope,
                                            "vocab_size": 300, "max_position_embeddings": 128})
    with pytest.raises(UnsupportedModelError, match="DynamicNTKScalingRoPE"):
        family_for(gemma4_text.Model(args))
