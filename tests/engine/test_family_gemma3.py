"""gemma3_text against mlx-lm's own generation on tiny folders: sliding and global layers, two
RoPE bases, (1 + w) norms, the bfloat16-rounded embedding scale, tied embeddings (as Gemma 3
ships), float32, 4-bit and float16 (where residuals are clipped)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models import gemma3_text

from engine.models import UnsupportedModelError, family_for
from engine.testing import FAMILY_CONFIGS
from tests.family_models import check_batch_equals_alone, check_cli_equals_mlx_lm, make_folder

CONFIG = FAMILY_CONFIGS["gemma3_text"][1]  # sliding and global layers, see engine/testing.py
# At make_folder's default scale (3.0) the tied head's logits are degenerate: the greedy token
# leads by ~8 nats (median), so even attending past the window changed no token in 40. At 1.5
# it leads by ~1-3 nats, the smallest lead is ~0.03 (far above the ~1e-5 kernel noise), and a
# wrong window or attention scale flips a token within ~30.
SCALE = 1.5


def _tie(folder: Path) -> Path:
    """Drop lm_head from the folder: mlx-lm then ties the head to the embedding, as Gemma 3's
    checkpoints are."""
    weights = mx.load(str(folder / "model.safetensors"))
    weights = {k: v for k, v in weights.items() if not k.startswith("lm_head.")}
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: f for k, f in index["weight_map"].items()
                           if not k.startswith("lm_head.")}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))
    return folder


def _to_float16(folder: Path, big_norm: float) -> Path:
    """The folder in float16, one post-attention norm weight raised so that layer's residual
    sum passes float16's range: mlx-lm clips it (clip_residual) rather than making inf."""
    weights = mx.load(str(folder / "model.safetensors"))
    weights = {k: v.astype(mx.float16) for k, v in weights.items()}
    name = "model.layers.1.post_attention_layernorm.weight"
    weights[name] = (weights[name] * big_norm).astype(mx.float16)
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3")
    f32 = _tie(make_folder(root / "f32", gemma3_text, CONFIG, scale=SCALE))
    q4 = _tie(make_folder(root / "q4", gemma3_text, CONFIG, scale=SCALE, quantize=True))
    # A window the 40 tokens never pass: past it, mlx-lm's rotating cache holds the keys in
    # ring order, and its attention sums them in that order (the engine: in position order),
    # which in float16 shows as a 1-ulp logprob now and then.
    wide = {**CONFIG, "sliding_window": 64}
    f16 = _to_float16(_tie(make_folder(root / "f16", gemma3_text, wide, scale=SCALE)), 1e4)
    return {"f32": f32, "q4": q4, "f16": f16}


@pytest.mark.slow
def test_greedy_equals_mlx_lm_f32(folders):
    check_cli_equals_mlx_lm(folders["f32"], "f32")


@pytest.mark.slow
def test_greedy_equals_mlx_lm_q4(folders):
    check_cli_equals_mlx_lm(folders["q4"], "q4")


@pytest.mark.slow
def test_greedy_equals_mlx_lm_f16_with_clipped_residuals(folders):
    """The folder's own float16 ("q4" = as shipped), bit for bit. On MLX's attention ops: the
    native attention kernel rounds float16 differently from mlx-lm's attention (within tolerance,
    tests/engine/test_attention.py)."""
    check_cli_equals_mlx_lm(folders["f16"], "q4", 40, "--attention", "mlx")


@pytest.mark.slow
def test_batched_equals_alone_q4(folders):
    check_batch_equals_alone(folders["q4"], "q4", long_prompt_tokens=90)


def test_layers_and_windows_follow_the_pattern():
    model = gemma3_text.Model(gemma3_text.ModelArgs.from_dict({**CONFIG, "vocab_size": 64}))
    family = family_for(model)
    assert [kv.window for kv in family.layer_kv()] == [20, 20, None, 20]
    assert family.describe_layers()[0] == (
        "3 of 4 layers attend over a sliding window of 20 tokens")


def test_dynamic_rope_scaling_is_refused():
    """Its base depends on the call's length and an int offset: not one position per row."""
    model = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(
        {**CONFIG, "vocab_size": 64, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}))
    with pytest.raises(UnsupportedModelError, match="DynamicNTKScalingRoPE"):
        family_for(model)
