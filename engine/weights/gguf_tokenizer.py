"""The tokenizer a GGUF describes in its metadata, as an mlx-lm TokenizerWrapper."""

from __future__ import annotations

from typing import Any

from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper

from engine.weights.gguf import metadata_value

# GPT-2's pre-tokenizer regex. llama.cpp's "smollm" pre-tokenizer runs it after isolating
# every digit (\p{N}), so numbers tokenize one digit per token.
_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4


def gguf_tokenizer(metadata: dict) -> TokenizerWrapper:
    """Byte-level BPE tokenizer equivalent to llama.cpp's for a "smollm" GGUF."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model_kind = metadata_value(metadata, "tokenizer.ggml.model")
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if model_kind != "gpt2" or pre not in ("smollm", "default", "gpt-2"):
        raise ValueError(f"unsupported GGUF tokenizer: model {model_kind!r}, pre {pre!r}")

    tokens: list[str] = list(metadata_value(metadata, "tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ")) for m in metadata_value(metadata, "tokenizer.ggml.merges")]
    if any(len(m) != 2 for m in merges):
        raise ValueError("GGUF merges must be 'left right' pairs")
    token_types = metadata["tokenizer.ggml.token_type"].tolist()

    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    splits = [pre_tokenizers.Split(Regex(_GPT2_SPLIT), behavior="isolated")]
    if pre == "smollm":
        splits.insert(0, pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, <|im_end|>, ...) must match whole, before the BPE.
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, kind in zip(tokens, token_types, strict=True)
            if kind == _TOKEN_CONTROL
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, kind in zip(tokens, token_types, strict=True)
            if kind == _TOKEN_USER_DEFINED
        ]
    )

    def token(key: str) -> str | None:
        return tokens[int(metadata[key].item())] if key in metadata else None

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=token("tokenizer.ggml.bos_token_id"),
        eos_token=token("tokenizer.ggml.eos_token_id"),
        unk_token=token("tokenizer.ggml.unknown_token_id"),
        pad_token=token("tokenizer.ggml.padding_token_id"),
        chat_template=metadata.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
        model_max_length=int(metadata_value(metadata, "llama.context_length")),
    )
    return TokenizerWrapper(hf, BPEStreamingDetokenizer, eos_token_ids=_chat_eos_ids(hf, metadata))


def _chat_eos_ids(hf: Any, metadata: dict) -> list[int]:
    """Ids that end generation: the GGUF eos, <|im_end|> and <|endoftext|>.

    In this GGUF eos (2) *is* <|im_end|>, the token the chat template closes every turn
    with. <|endoftext|> (0) ends a document in pretraining; it is added so that a model
    which emits it stops instead of rambling into a new document.
    """
    ids = [int(metadata_value(metadata, "tokenizer.ggml.eos_token_id"))]
    vocab = hf.get_vocab()
    for text in ("<|im_end|>", "<|endoftext|>"):
        if text in vocab and vocab[text] not in ids:
            ids.append(vocab[text])
    return ids
