"""The family registry: every model_type maps to one adapter, and what it cannot run it refuses
by name before any forward (engine/models/)."""

from __future__ import annotations

import json

import pytest
from mlx_lm.models import llama, qwen3

from engine.model_loader import load_folder
from engine.models import FAMILIES, UnsupportedModelError, family_for, supported_model_types
from tests.family_models import make_folder

TINY = {"hidden_size": 32, "num_hidden_layers": 1, "intermediate_size": 64,
        "num_attention_heads": 2, "num_key_value_heads": 1, "rms_norm_eps": 1e-5,
        "vocab_size": 300, "tie_word_embeddings": True}


def test_every_model_type_has_one_family():
    types = [t for family in FAMILIES for t in family.model_types]
    assert len(types) == len(set(types))
    assert set(supported_model_types()) == set(types)
    for family in FAMILIES:
        assert family.name and family.differs and family.model_class.__name__ == "Model"


def test_unknown_model_type_is_refused_by_name_before_loading(tmp_path):
    folder = make_folder(tmp_path / "m", llama, {**TINY, "model_type": "llama"})
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "starcoder2"  # mlx-lm has it; the engine has no adapter for it
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError) as info:
        load_folder(folder)
    message = str(info.value)
    assert "'starcoder2' is not supported" in message
    assert "llama" in message and "qwen3" in message  # lists the supported ones


@pytest.mark.parametrize("model_type", ["mamba2", "nemotron_h", "lfm2", "granitemoehybrid",
                                        "falcon_h1"])
def test_other_recurrent_families_are_refused_as_what_they_are(tmp_path, model_type):
    folder = make_folder(tmp_path / "m", llama, {**TINY, "model_type": "llama"})
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = model_type
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError) as info:
        load_folder(folder)
    message = str(info.value)
    assert f"'{model_type}' is a recurrent" in message and "qwen3_next" in message


def test_class_that_does_not_match_its_adapter_is_refused():
    """A qwen3 model whose config says llama: llama maths on it would be silently wrong."""
    args = qwen3.ModelArgs.from_dict({**TINY, "model_type": "qwen3", "head_dim": 16,
                                      "rope_theta": 10000.0,
                                      "max_position_embeddings": 128})
    model = qwen3.Model(args)
    model.args.model_type = "llama"
    with pytest.raises(UnsupportedModelError) as info:
        family_for(model)
    message = str(info.value)
    assert "mlx_lm.models.qwen3.Model" in message and "mlx_lm.models.llama.Model" in message


def test_the_engine_refuses_an_unsupported_model_at_start(tmp_path):
    from engine.config import EngineConfig
    from engine.engine import Engine

    folder = make_folder(tmp_path / "m", llama, {**TINY, "model_type": "llama"})
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "starcoder2"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="'starcoder2' is not supported"):
        Engine(EngineConfig(model=str(folder), num_kv_blocks=8)).start()


def test_models_command_lists_every_family(capsys):
    from app.cli import main

    assert main(["models", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["families"]
    assert [row["family"] for row in listed] == [family.name for family in FAMILIES]
    assert sorted(t for row in listed for t in row["model_types"]) == supported_model_types()


def test_step_records_count_blocks_every_sliding_layer_has_left_behind(tmp_path):
    """The pool keeps blocks behind a sliding window (the global layers still read them); the
    step record counts them and the bytes a per-layer-group allocation would free."""
    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.sampling import SamplingParams

    config = {**TINY, "model_type": "llama", "num_hidden_layers": 3, "head_dim": 16,
              "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
              "sliding_window": 20, "max_position_embeddings": 256}
    folder = make_folder(tmp_path / "m", llama, config)
    with Engine(EngineConfig(model=str(folder), weights="f32", num_kv_blocks=32,
                             max_num_batched_tokens=64)) as engine:
        engine.generate(list(range(3, 103)), SamplingParams(max_tokens=4, ignore_eos=True))
        records = engine.steps.recent()
    last = records[-1]  # a decode row at position 102: it and later rows see positions > 82,
    assert last.decode_rows == 1 and last.entries[0].context_len == 103
    assert last.window_blocks_behind == (103 - 20 + 1) // 16 == 5  # so blocks 0-4 are behind
    # 2 sliding layers x (keys + values) x 1 kv head x 16 slots x head_dim 16 x 4 bytes
    assert last.window_bytes_reclaimable == 5 * 2 * 2 * 1 * 16 * 16 * 4
    first = records[0]  # the first prefill chunk: 64 positions, blocks 0-2 behind
    assert first.window_blocks_behind == (64 - 20 + 1) // 16
