"""phi3 against mlx-lm's own generation on tiny folders: fused qkv_proj and gate_up_proj, plain
RoPE (Phi-3-mini-4k's shape: full rotary, one kv head per head, its own lm_head) and partial
longrope-scaled RoPE (Phi-4-mini's shape: 3/4 of each head rotated, grouped kv heads, tied
embeddings). mlx-lm's "linear" phi3 scaling is not tested: transformers refuses such a config
when the tokenizer loads, so no folder with it loads in mlx-lm either."""

from __future__ import annotations

import pytest
from mlx_lm.models import phi3

from engine.testing import FAMILY_CONFIGS
from tests.family_models import check_batch_equals_alone, check_cli_equals_mlx_lm, make_folder

CONFIGS = {"phi3-plain": FAMILY_CONFIGS["phi3"][1],
           "phi3-longrope": FAMILY_CONFIGS["phi3-longrope"][1]}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def folders(request, tmp_path_factory):
    config = CONFIGS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    return (make_folder(root / "f32", phi3, config),
            make_folder(root / "q4", phi3, config, quantize=True))


@pytest.mark.slow
def test_greedy_equals_mlx_lm_f32(folders):
    check_cli_equals_mlx_lm(folders[0], "f32")


@pytest.mark.slow
def test_greedy_equals_mlx_lm_q4(folders):
    check_cli_equals_mlx_lm(folders[1], "q4")


@pytest.mark.slow
def test_batched_equals_alone_q4(folders):
    check_batch_equals_alone(folders[1], "q4", long_prompt_tokens=90)


def test_rope_variants_are_the_ones_meant():
    """The configs above reach the RoPE variants they are named for."""
    rope = {name: phi3.Model(phi3.ModelArgs.from_dict({**config, "vocab_size": 64}))
            .layers[0].self_attn.rope for name, config in CONFIGS.items()}
    assert type(rope["phi3-plain"]).__name__ == "RoPE" and rope["phi3-plain"].dims == 32
    assert type(rope["phi3-longrope"]).__name__ == "SuScaledRoPE"
    assert rope["phi3-longrope"].dim == 24 and rope["phi3-longrope"]._scale > 1.0
