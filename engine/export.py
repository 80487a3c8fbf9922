"""Write the embedded model as an mlx-lm folder, so mlx-lm itself can serve the same weights
as a side-by-side reference (`batchscope export-model`)."""

from __future__ import annotations

import json
from pathlib import Path

from engine.model_loader import load_embedded
from engine.weights.formats import validate_weights


def portable_tokenizer_config(path: Path, chat_template: str | None) -> None:
    """Make tokenizer_config.json readable by transformers 4.x as well as 5.x.

    transformers 5 names the class "TokenizersBackend" (unknown to 4.x) and keeps the chat
    template only in chat_template.jinja; the 4.x name and an inline template work in both.
    """
    config = json.loads(path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config.pop("backend", None)
    if chat_template:
        config["chat_template"] = chat_template
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def export_model(out_dir: str | Path, weights: str = "q4") -> Path:
    """Write the embedded model as an mlx-lm folder; return its path.

    The folder (config.json, model.safetensors, tokenizer files, generation_config.json)
    loads with `mlx_lm.load`, `mlx_lm generate --model DIR` and `mlx_lm.server --model DIR`.
    With weights="q4" it holds the GGUF's quantized tensors unchanged.
    """
    from mlx_lm.utils import save_config, save_model

    validate_weights(weights)
    if weights == "auto":
        raise ValueError("export_model needs an explicit weights format: q4, f32 or bf16")
    loaded = load_embedded(weights)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    save_model(out, loaded.model)
    save_config(dict(loaded.config), out / "config.json")
    loaded.tokenizer.save_pretrained(str(out))
    portable_tokenizer_config(out / "tokenizer_config.json", loaded.tokenizer.chat_template)
    generation = {
        "bos_token_id": loaded.config["bos_token_id"],
        "eos_token_id": loaded.config["eos_token_id"],
        "pad_token_id": loaded.tokenizer.pad_token_id,
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return out
