"""gpt_oss against mlx-lm's own generation on tiny folders: attention sinks, q/k/v/o biases,
sliding layers alternating with full ones, YaRN RoPE, and the biased mixture of experts."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import gpt_oss
from mlx_lm.models.activations import swiglu_oai

from engine.models.gpt_oss import oai_experts, uncompiled_swiglu_oai
from engine.testing import FAMILY_CONFIGS
from tests.family_models import check_batch_equals_alone, check_cli_equals_mlx_lm, make_folder

pytestmark = pytest.mark.slow

CONFIG = FAMILY_CONFIGS["gpt_oss"][1]
WINDOW = CONFIG["sliding_window"]


def _spread(folder: Path, seed: int = 1) -> Path:
    """Give the sinks and the expert biases values that matter: make_folder leaves the expert
    biases (2-d, initialised to zeros) at zero and the sinks near it."""
    mx.random.seed(seed)
    for file in sorted(folder.glob("*.safetensors")):
        weights = mx.load(str(file))
        for name, w in weights.items():
            if name.endswith("self_attn.sinks"):
                weights[name] = 2.0 * mx.random.normal(w.shape, dtype=w.dtype)
            elif ".mlp.experts." in name and name.endswith(".bias"):
                weights[name] = 0.5 * mx.random.normal(w.shape, dtype=w.dtype)
        mx.save_safetensors(str(file), weights, metadata={"format": "mlx"})
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss")
    return (_spread(make_folder(root / "f32", gpt_oss, CONFIG)),
            _spread(make_folder(root / "q4", gpt_oss, CONFIG, quantize=True)))


def test_uncompiled_swiglu_gives_mlx_lm_compiled_bits():
    mx.random.seed(0)
    for dtype in (mx.float32, mx.bfloat16):
        gate = (6.0 * mx.random.normal((2, 513, 4, 64))).astype(dtype)
        x = (6.0 * mx.random.normal((2, 513, 4, 64))).astype(dtype)
        assert mx.array_equal(swiglu_oai(gate, x),
                              uncompiled_swiglu_oai(gate, x, 1.702, 7.0)).item()


@pytest.mark.parametrize("quantize", [False, True])
def test_experts_give_mlx_lm_switch_glu_bits(quantize):
    """Below and above SwitchGLU's sort threshold (64 choices)."""
    mx.random.seed(0)
    model = gpt_oss.Model(gpt_oss.ModelArgs.from_dict({**CONFIG, "vocab_size": 128}))
    switch = model.model.layers[0].mlp.experts
    if quantize:
        nn.quantize(switch, group_size=64, bits=4)
    for rows in (1, 5, 40):
        x = 3.0 * mx.random.normal((1, rows, 64))
        indices = mx.random.randint(0, 4, (1, rows, 2))
        assert mx.array_equal(oai_experts(switch)(x, indices), switch(x, indices)).item()


def test_layers_say_their_sinks_and_windows(folders):
    from engine.model_loader import load_folder
    from engine.models import family_for

    loaded = load_folder(folders[0], "f32")
    family = family_for(loaded.model, loaded.config)
    assert [kv.window for kv in family.layer_kv()] == [WINDOW, None, WINDOW, None]
    lines = family.describe_layers()
    assert lines[0] == "2 of 4 layers attend over a sliding window of 16 tokens"
    assert "4 of 4 layers with attention sinks" in lines[1] and "MLX ops" in lines[1]
    assert lines[2] == "4 of 4 layers route each token to 2 of 4 experts"
    assert family.expert_layers() == {0: 4, 1: 4, 2: 4, 3: 4}


def test_greedy_equals_mlx_lm_f32(folders):
    check_cli_equals_mlx_lm(folders[0], "f32")


def test_greedy_equals_mlx_lm_q4(folders):
    check_cli_equals_mlx_lm(folders[1], "q4")


def test_batched_equals_alone_q4(folders):
    check_batch_equals_alone(folders[1], "q4", long_prompt_tokens=90)


def test_batched_equals_alone_f32_batch_invariant(folders):
    check_batch_equals_alone(folders[0], "f32", long_prompt_tokens=90, batch_invariant=True)
