"""Long prompts: many prefill chunks through the native attention kernel, the KV pool's dtype
(kv_dtype), and the memory a long prefill takes."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.kv_cache import KVPool
from engine.sampling import SamplingParams
from engine.testing import tiny_model

CONTEXT = 4096


def engine_for(**overrides) -> Engine:
    config = dict(max_num_seqs=4, max_num_batched_tokens=512, block_size=16,
                  num_kv_blocks=2 * CONTEXT // 16, enable_prefix_caching=False)
    config.update(overrides)
    # 8 heads of 64 over 2 kv heads: a score tensor of rows x context x heads is large.
    return Engine(EngineConfig(**config), loader=lambda: tiny_model(
        quantize=False, max_position_embeddings=CONTEXT, hidden_size=128, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64)).start()


def prompt(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 259, n)]


def test_kv_dtype_is_checked():
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        EngineConfig(kv_dtype="int8")


def test_a_pool_wider_than_the_model_is_refused_with_its_dtypes():
    pool = KVPool(1, 4, 16, 2, 8, dtype=mx.float32)
    keys = mx.zeros((3, 2, 8), dtype=mx.bfloat16)
    with pytest.raises(ValueError, match="float32 KV cache is wider than the model's "
                                         "mlx.core.bfloat16"):
        pool.write(0, mx.arange(3), keys, keys)


def test_a_float16_pool_holds_half_the_bytes_and_rounded_keys():
    eng = engine_for(kv_dtype="float16")
    full = engine_for()
    try:
        ids = prompt(700)
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        half_out, full_out = (e.submit(ids, params).result() for e in (eng, full))
        assert eng.pool.dtype == mx.float16 and full.pool.dtype == mx.float32
        assert eng.pool.nbytes() * 2 == full.pool.nbytes()
        assert half_out.completion_tokens == full_out.completion_tokens == 8
    finally:
        eng.stop()
        full.stop()


def run_traced(eng: Engine, ids: list[int], params: SamplingParams, company: bool):
    """The request's keys and values at every position and its sampled logits (bits), run
    alone or beside other requests' prefills and decodes."""
    others = [eng.submit(prompt(n, seed=n), params) for n in (40, 900, 1700)] if company else []
    r = eng.submit(ids, params, trace=True).result()
    for h in others:
        h.result()
    kv = np.concatenate([t["kv"] for t in r.trace], axis=3)
    logits = np.stack([t["logits"] for t in r.trace if t["logits"] is not None])
    return kv, logits, r.token_ids


# The MLX-ops variants are slow on the CPU: they run in `make test`, not `make test-fast`.
MLX_SLOW = pytest.param("mlx", marks=pytest.mark.slow)


@pytest.mark.parametrize("attention", ["native", MLX_SLOW])
def test_a_long_prompt_gets_the_same_bits_in_any_chunking_alone_or_batched(attention):
    """In the native kernel a row's attention carries its own bits, and in batch-invariant
    mode the linear layers do too: a 3000-token prompt prefilled in chunks of 512 or of 96
    rows, alone or beside other requests, writes the same keys and values at every position
    and samples from the same logits. MLX's ops (a matmul over each chunk) do not: the check
    sees it."""
    from native_ops import native_op

    if attention == "native":
        native_op("paged_attention")
    ids = prompt(3000, seed=1)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    runs = []
    for chunk in (512, 96):
        eng = engine_for(batch_invariant=True, max_num_batched_tokens=chunk, attention=attention)
        try:
            runs += [run_traced(eng, ids, params, company) for company in (False, True)]
        finally:
            eng.stop()
    kv, logits, ids_out = runs[0]
    assert kv.shape[3] == 3000 + 5 and logits.shape[0] == 6
    same = [np.array_equal(r[0], kv) and np.array_equal(r[1], logits) for r in runs[1:]]
    if attention == "native":
        assert all(same) and all(r[2] == ids_out for r in runs)
    else:
        assert not all(same)


@pytest.mark.parametrize("attention", ["native", MLX_SLOW])
def test_long_prefill_keeps_no_rows_x_context_x_heads_tensor(attention):
    """Peak memory over a 4000-token prefill in 512-row chunks (MLX's counters): the native
    kernel stays under the size of one chunk's float32 scores (512 x context x 8 heads); the
    MLX-ops path makes such a tensor per layer, which shows the measure can see one."""
    from native_ops import native_op

    if attention == "native":
        native_op("paged_attention")
    eng = engine_for(attention=attention)
    try:
        scores = 512 * 4000 * 8 * 4
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        eng.submit(prompt(4000, seed=2), SamplingParams(max_tokens=1)).result()
        extra = mx.get_peak_memory() - base
        if attention == "native":
            assert extra < scores / 2, extra
        else:
            assert extra > scores, extra
    finally:
        eng.stop()
