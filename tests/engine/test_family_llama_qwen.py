"""llama, mistral, qwen2, qwen3 and smollm3 against mlx-lm's own generation on tiny folders."""

from __future__ import annotations

import pytest
from mlx_lm.models import llama, qwen2, qwen3, smollm3

from tests.family_models import check_batch_equals_alone, check_cli_equals_mlx_lm, make_folder

pytestmark = pytest.mark.slow

BASE = {"hidden_size": 64, "num_hidden_layers": 3, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "tie_word_embeddings": True}

FAMILIES = {
    "llama": (llama, {**BASE, "model_type": "llama", "head_dim": 16}),
    "llama-sliding": (llama, {**BASE, "model_type": "llama", "head_dim": 16,
                              "layer_types": ["sliding_attention", "sliding_attention",
                                              "full_attention"], "sliding_window": 24}),
    "mistral": (llama, {**BASE, "model_type": "mistral", "tie_word_embeddings": False}),
    "qwen2": (qwen2, {**BASE, "model_type": "qwen2"}),
    "qwen3": (qwen3, {**BASE, "model_type": "qwen3", "head_dim": 16}),
    "smollm3": (smollm3, {**BASE, "model_type": "smollm3", "no_rope_layer_interval": 2}),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    module, config = FAMILIES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    return (make_folder(root / "f32", module, config),
            make_folder(root / "q4", module, config, quantize=True))


def test_greedy_equals_mlx_lm_f32(family):
    check_cli_equals_mlx_lm(family[0], "f32")


def test_greedy_equals_mlx_lm_q4(family):
    check_cli_equals_mlx_lm(family[1], "q4")


def test_batched_equals_alone_q4(family):
    check_batch_equals_alone(family[1], "q4", long_prompt_tokens=90)
