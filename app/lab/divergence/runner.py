"""The engines of a series of divergence experiments, and one side's run on them: the target
with trace=True (each step hands back the keys and values it wrote and its logits) and the
other requests that share its steps, all in one Engine.submit_many call, so the batch
composition is the same on every run of a side."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict
from types import MappingProxyType
from typing import Any

from app.lab.divergence.compare import SideRun, compare
from app.lab.divergence.record import DivergenceRecord
from app.lab.divergence.sides import SideConfig
from engine.config import EngineConfig
from engine.engine import Engine, EngineError, Submission
from engine.events import FinishEvent, TokenEvent
from engine.sampling import SamplingParams
from engine.telemetry import StepRecord

Progress = Callable[[str], None] | None
# Builds the model for a weights format (on the engine thread); None: the engine's own loader.
Loader = Callable[[str], Any] | None

# Other requests' prompts are cut from this text (any tokenizer can encode it).
FILLER = (
    "The harbour woke before the sun. Fishermen untangled nets on the stone quay while gulls "
    "argued over the scraps of yesterday's catch, and the smell of tar and salt drifted up "
    "the narrow streets toward the market square, where the baker was already stacking warm "
    "loaves in the window and the clockmaker's apprentice swept the steps of the shop. "
)


def _blocks(lengths: Iterable[int], block_size: int) -> int:
    return sum(-(-n // block_size) + 1 for n in lengths)


def _blocks_needed(prompt: str | list[int], side: SideConfig, max_tokens: int,
                   chat: bool) -> int:
    """KV blocks one run of a side needs, with room to spare (no preemption wanted: it would
    make the target recompute its cache). A string's token count is bounded by its bytes."""
    bound = (len(prompt.encode("utf-8")) + (64 if chat else 8) if isinstance(prompt, str)
             else len(prompt))
    need = (_blocks([bound + max_tokens, 1], side.block_size)
            + _blocks([n + side.alongside_max_tokens for n in side.alongside], side.block_size))
    return 2 * need + 8


class DivergenceRunner:
    """Owns the engines of a series of experiments; one per distinct weights/engine settings.

    Prefix caching is off: a second run of the same prompt on a shared engine would otherwise
    read the first run's cached keys instead of computing its own."""

    def __init__(self, loader: Loader = None, model: str = "embedded", progress: Progress = None):
        self.loader = loader
        self.model = model
        self.progress = progress or (lambda message: None)
        self._engines: dict[tuple, Engine] = {}
        self._runs = 0
        self._reserved: dict[tuple, int] = {}  # engine key -> KV blocks to allocate

    def __enter__(self) -> DivergenceRunner:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for engine in self._engines.values():
            engine.stop()
        self._engines.clear()

    @property
    def engines(self) -> Mapping[tuple, Engine]:
        """The engines it holds by SideConfig.engine_key(), read-only."""
        return MappingProxyType(self._engines)

    def reserve(self, prompts: Iterable[str | list[int]], sides: Iterable[SideConfig],
                max_tokens: int, chat: bool = False) -> None:
        """Size the engines' KV pools for all these runs up front: a pool found too small
        later means loading the model again."""
        prompts = list(prompts)
        for side in sides:
            need = max(_blocks_needed(p, side, max_tokens, chat) for p in prompts)
            key = side.engine_key()
            self._reserved[key] = max(self._reserved.get(key, 0), need)

    def _engine(self, side: SideConfig, blocks: int, label: str) -> Engine:
        key = side.engine_key()
        blocks = max(blocks, self._reserved.get(key, 0))
        engine = self._engines.get(key)
        if engine is not None and engine.config.num_kv_blocks >= blocks:
            return engine
        if engine is not None:  # too small for this experiment: start a bigger one
            engine.stop()
            blocks = max(blocks, 2 * engine.config.num_kv_blocks)
        extra = {"batch_invariant": True} if side.batch_invariant else {}
        config = EngineConfig(
            model=self.model, weights=side.weights, max_num_seqs=side.max_num_seqs,
            max_num_batched_tokens=side.max_num_batched_tokens, block_size=side.block_size,
            num_kv_blocks=max(blocks, 16), enable_prefix_caching=False, step_history=4096,
            row_kernels=side.row_kernels, activations=side.activations,
            speculative=side.speculative,
            num_speculative_tokens=side.num_speculative_tokens,
            speculative_max_batch=side.max_num_seqs, draft_model=side.engine_draft_model,
            **extra)
        loader = None
        if self.loader is not None:
            user_loader, weights = self.loader, side.weights

            def loader():
                return user_loader(weights)

        self.progress(f"side {label}: loading the model ({side.weights} weights)")
        engine = Engine(config, loader=loader).start()
        self._engines[key] = engine
        return engine

    def encode(self, engine: Engine, prompt: str | list[int], chat: bool) -> list[int]:
        if not isinstance(prompt, str):
            return [int(t) for t in prompt]
        if chat:
            return engine.encode_chat([{"role": "user", "content": prompt}])
        return engine.encode(prompt)

    def run_side(self, prompt: str | list[int], side: SideConfig, max_tokens: int, *,
                 chat: bool = False, ignore_eos: bool = True, label: str = "") -> SideRun:
        engine = self._engine(side, _blocks_needed(prompt, side, max_tokens, chat), label)
        engine.kernel_policy = side.policy  # read by the engine thread at every step
        ids = self.encode(engine, prompt, chat)
        target_params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
        other_params = SamplingParams(max_tokens=side.alongside_max_tokens, ignore_eos=True)
        others = [_filler(engine, n, i) for i, n in enumerate(side.alongside)]
        engine.validate(ids, target_params)
        for other in others:
            engine.validate(other, other_params)

        self._runs += 1
        target_id = f"divergence-{self._runs}-target"
        target = Submission(ids, target_params, target_id, trace=True)
        companions = [Submission(other, other_params, f"divergence-{self._runs}-other-{i}")
                      for i, other in enumerate(others)]
        self.progress(f"side {label}: running {side.label()}")
        first_step = engine.step_count + 1  # the engine is idle between runs
        # Every step of this run, whatever the ring buffer's size: the engine is idle before
        # the submission, and it appends a step's record before that step's events go out.
        ran: list[StepRecord] = []
        unsubscribe = engine.steps.subscribe(ran.append)
        try:
            if companions and side.join_at > 0:
                handles = engine.submit_many([target])
                handles += engine.submit_many(companions, after=(target_id, side.join_at))
            else:
                handles = engine.submit_many([target] + companions)
            try:
                # The target's token events, kept to record the run like a served one.
                events = [e for e in handles[0] if isinstance(e, TokenEvent)]
                # Wait for the others too: the next run needs an idle engine.
                results = [handle.result() for handle in handles]
            except BaseException:
                for handle in handles:  # leave nothing running behind a failed run
                    handle.cancel()
                for handle in handles:
                    handle.result()
                raise
        finally:
            unsubscribe()
        target = results[0]
        if target.reason == "error" or target.trace is None:
            raise EngineError(f"side {label}: the target request failed: {target.error}")
        base = (target.steps[0] if target.steps else first_step) - 1
        last = target.steps[-1] if target.steps else base
        steps = []
        for record in ran:
            if base < record.step <= last:
                mine = next((e for e in record.entries if e.request_id == target_id), None)
                steps.append({
                    "step": record.step - base, "engine_step": record.step,
                    "path": record.kernel_path, "rows": record.total_rows,
                    "prefill_rows": record.prefill_rows, "decode_rows": record.decode_rows,
                    "requests": len(record.entries),
                    "target_phase": mine.phase if mine else None,
                    "target_rows": mine.rows if mine else 0,
                    "target_drafted": mine.drafted if mine else 0,
                    "target_accepted": mine.accepted if mine else 0})
        trace = [{**t, "step": t["step"] - base} for t in target.trace]
        tokens = [{"token_id": e.token_id, "text": e.text, "logprob": e.logprob,
                   "time": e.time, "step": e.step - base, "drafted": e.drafted}
                  for e in events]
        engine_steps = [{**r.to_dict(), "step": r.step - base, "engine_step": r.step}
                        for r in ran]
        # The side's kernel policy is set per run, not in the engine's configuration.
        engine_config = {**asdict(engine.config), "max_model_len": engine.max_model_len,
                         "kernel_policy": side.kernel_policy,
                         "kernel_threshold": side.kernel_threshold}
        return SideRun(side=side, prompt_ids=ids, finish=target, trace=trace, steps=steps,
                       others_joined=shared_steps(target, results[1:]), model=engine.loaded.name,
                       weights=engine.loaded.weights,
                       eos_ids=set(getattr(engine.tokenizer, "eos_token_ids", ()) or ()),
                       tokens=tokens, engine_steps=engine_steps,
                       request_ids={"target": target_id,
                                    "alongside": [c.request_id for c in companions]},
                       engine_config=engine_config)

    def run(self, prompt: str | list[int], a: SideConfig, b: SideConfig, max_tokens: int = 64,
            *, top_k: int = 5, chat: bool = False, ignore_eos: bool = True) -> DivergenceRecord:
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        if isinstance(prompt, str) and not prompt:
            raise ValueError("prompt is empty")
        t0 = time.perf_counter()
        self.reserve([prompt], [a, b], max_tokens, chat)
        run_a = self.run_side(prompt, a, max_tokens, chat=chat, ignore_eos=ignore_eos, label="A")
        run_b = self.run_side(prompt, b, max_tokens, chat=chat, ignore_eos=ignore_eos, label="B")
        if run_a.prompt_ids != run_b.prompt_ids:
            raise ValueError("the two sides tokenize the prompt differently: compare one model")
        self.progress("comparing the two sides")
        tokenizer = self._engines[a.engine_key()].tokenizer
        record = compare(run_a, run_b, lambda ids: tokenizer.decode(ids), top_k=top_k)
        record.prompt = prompt if isinstance(prompt, str) else None
        record.chat, record.max_tokens, record.ignore_eos = chat, max_tokens, ignore_eos
        record.elapsed_s = round(time.perf_counter() - t0, 3)
        record.backend = backend()
        return record


def shared_steps(target: FinishEvent, others: list[FinishEvent]) -> bool:
    """Whether any of the other requests ran in a step of the target."""
    mine = set(target.steps)
    return any(mine.intersection(other.steps) for other in others)


def _filler(engine: Engine, n: int, index: int) -> list[int]:
    """n token ids of filler text, a different cut for each other request."""
    shift = 7 * index
    text = FILLER
    ids = engine.encode(text)
    while len(ids) < n + shift:
        text += FILLER
        ids = engine.encode(text)
    return ids[shift:shift + n]


def backend() -> dict:
    """Where the experiment ran; the BLAS by its library name (a record is shared and saved:
    it does not say where the library lives on this machine)."""
    from engine.platform import backend_info, blas_name

    info = backend_info()
    return info | {"blas": blas_name(info.get("blas"))}



def run_experiment(prompt: str | list[int], a: SideConfig, b: SideConfig, max_tokens: int = 64,
                   loader: Loader = None, top_k: int = 5, progress: Progress = None, *,
                   model: str = "embedded", chat: bool = False,
                   ignore_eos: bool = True) -> DivergenceRecord:
    """Run `prompt` greedily on side A and side B and return the divergence record.

    loader(weights) builds the model on the engine thread (tests: a tiny model); None loads
    `model` with the side's weights. EOS is ignored by default so both sides run max_tokens."""
    with DivergenceRunner(loader, model, progress) as runner:
        return runner.run(prompt, a, b, max_tokens, top_k=top_k, chat=chat,
                          ignore_eos=ignore_eos)

