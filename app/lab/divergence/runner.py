"""Divergence experiments: one prompt, greedily, on two engine set-ups; where the outputs part
and which cache write started it.

A side is a weight format, a kernel policy and a batch context: the target prompt alone, or
alongside other requests (given by their prompt lengths) that share its steps, joining with it
or after it has produced `join_at` tokens. The target runs with trace=True, so each of its steps
hands back the keys and values it wrote and its logits. The record follows cause to effect, as
the mini-vllm-rs write-up had to (the fork shows up long after the batch that caused it has
changed):

    KV first differs at position P, written at step S_A (gemm, 124 rows) vs S_B (gemv, 4 rows)
    -> first logit difference at output token i -> fork at output token j (top-2 margin m)

When both sides are bit-identical it says so, with the evidence: max |Δlogit| = 0 over every
compared token and max |ΔKV| = 0 over every compared position. It never invents a difference.

Batch composition must be the same on every run of a side, or the comparison means nothing:
requests submitted one by one from a client thread race the engine thread (the target could be
scheduled a step before the others arrive). So a side's requests go in with one
Engine.submit_many call: the target and the others together, or the others held back by the
engine until the target has produced `join_at` tokens.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from engine.config import WEIGHT_FORMATS, EngineConfig, KernelPolicy, check_native_setting
from engine.engine import Engine, EngineError, Submission
from engine.events import FinishEvent, TokenEvent
from engine.sampling import SamplingParams
from engine.speculative import METHODS as SPECULATIVE_METHODS
from engine.speculative import common_prefix, draft_layers
from engine.telemetry import StepRecord

Progress = Callable[[str], None] | None
# Builds the model for a weights format (on the engine thread); None: the engine's own loader.
Loader = Callable[[str], Any] | None

MAX_ALONGSIDE = 32
MAX_ALONGSIDE_LEN = 8192

# Other requests' prompts are cut from this text (any tokenizer can encode it).
FILLER = (
    "The harbour woke before the sun. Fishermen untangled nets on the stone quay while gulls "
    "argued over the scraps of yesterday's catch, and the smell of tar and salt drifted up "
    "the narrow streets toward the market square, where the baker was already stacking warm "
    "loaves in the window and the clockmaker's apprentice swept the steps of the shop. "
)

# Varied prompts for search(): stories, facts, code, lists, numbers, dialogue.
BUILTIN_PROMPTS = [
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "The mechanic and the archivist entered the abandoned lunar greenhouse, following the "
    "distress signal. Mara",
    "Explain in simple terms why the sky is blue.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The three most important inventions of the nineteenth century were",
    "Here is a recipe for a simple tomato soup. Ingredients:",
    "Q: What is the capital of Australia?\nA:",
    "Dear hiring manager,\n\nI am writing to apply for the position of",
    "The history of the Roman Empire can be divided into",
    "In machine learning, overfitting happens when",
    "List of tips for a good night's sleep:\n1.",
    "The detective looked at the muddy footprints and said,",
    "To install the package, first open a terminal and",
    "Photosynthesis is the process by which plants",
    "The year was 2087, and the last library on Earth",
    "SELECT name, COUNT(*) FROM orders",
    "My favourite season is autumn because",
    "The quick brown fox jumps over the lazy dog. Then the fox",
    "Water boils at 100 degrees Celsius at sea level, but on a high mountain",
    "Alice: Did you finish the report?\nBob:",
]


# ---- sides ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class SideConfig:
    """One side of an experiment: how the target's steps are computed and what shares them."""

    weights: str = "auto"
    kernel_policy: str = "gemm"
    kernel_threshold: int = 1
    alongside: tuple[int, ...] = ()  # prompt lengths (tokens) of other requests
    join_at: int = 0  # others join in the step computing the target's output token #join_at
    alongside_max_tokens: int = 16  # tokens each other request generates (EOS ignored)
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 16
    block_size: int = 16
    batch_invariant: bool = False  # the engine's tiled, batch-invariant path (if it has one)
    # Few-row float32 gemm steps: the native kernel ("auto"/"native") or MLX's matmul ("mlx").
    decode_matmul: str = "auto"
    # Speculative decoding of the target (and the others): "off", "ngram" or "draft", k drafts
    # a step. A side speculates whatever shares its steps (no automatic turn-down).
    speculative: str = "off"
    num_speculative_tokens: int = 4
    # speculative "draft": the draft model, as the engine's --draft-model takes it (layers:N,
    # "embedded" or a folder); ignored by the other methods.
    draft_model: str | None = None

    def __post_init__(self) -> None:
        if self.weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, "
                             f"got {self.weights!r}")
        KernelPolicy(self.kernel_policy, self.kernel_threshold)  # raises on bad values
        check_native_setting("decode_matmul", self.decode_matmul)
        if self.speculative not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE_METHODS)}, "
                             f"got {self.speculative!r}")
        if self.speculative == "draft":
            if not self.draft_model:
                raise ValueError("speculative=draft needs a draft model: draft=layers:N (or "
                                 "'embedded', or a folder) in the side, or --draft-model")
            draft_layers(self.draft_model)  # raises on a bad layers:N
        alongside = tuple(self.alongside)
        if len(alongside) > MAX_ALONGSIDE:
            raise ValueError(f"at most {MAX_ALONGSIDE} other requests, got {len(alongside)}")
        for n in alongside:
            if not isinstance(n, int) or not 1 <= n <= MAX_ALONGSIDE_LEN:
                raise ValueError(f"alongside lengths must be whole numbers from 1 to "
                                 f"{MAX_ALONGSIDE_LEN}, got {n!r}")
        object.__setattr__(self, "alongside", alongside)
        if not isinstance(self.join_at, int) or self.join_at < 0:
            raise ValueError(f"join_at must be a non-negative integer, got {self.join_at!r}")
        for name in ("alongside_max_tokens", "max_num_batched_tokens", "max_num_seqs",
                     "block_size", "num_speculative_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @property
    def policy(self) -> KernelPolicy:
        return KernelPolicy(self.kernel_policy, self.kernel_threshold)

    def label(self) -> str:
        path = "batch-invariant" if self.batch_invariant else self.policy.describe()
        if not self.alongside:
            context = "alone"
        else:
            lengths = ",".join(str(n) for n in self.alongside)
            context = f"alongside {lengths}" + (f" from token {self.join_at}"
                                                 if self.join_at else "")
        matmul = "" if self.decode_matmul == "auto" else f" · matmul {self.decode_matmul}"
        spec = ("" if self.speculative == "off"
                else f" · {self.speculative} k={self.num_speculative_tokens}")
        if self.speculative == "draft":
            spec += f" ({self.draft_model})"
        return f"{self.weights} · {path}{matmul}{spec} · {context}"

    def engine_key(self) -> tuple:
        """Sides with equal keys share an engine (the kernel policy is set per run)."""
        return (self.weights, self.max_num_batched_tokens, self.max_num_seqs, self.block_size,
                self.batch_invariant, self.decode_matmul, self.speculative,
                self.num_speculative_tokens, self.engine_draft_model)

    @property
    def engine_draft_model(self) -> str | None:
        """The engine's draft_model: this side's, when it drafts with a model."""
        return self.draft_model if self.speculative == "draft" else None

    def to_dict(self) -> dict:
        return {**asdict(self), "alongside": list(self.alongside), "label": self.label()}

    @classmethod
    def from_dict(cls, data: dict) -> SideConfig:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    @classmethod
    def parse(cls, spec: str, base: SideConfig | None = None) -> SideConfig:
        """`key=value` pairs separated by commas, over `base`: e.g.
        "weights=f32,policy=auto,threshold=8,alongside=120,60,30,join=4" (bare numbers after
        alongside= extend the list; 120+60+30 works too). Keys: see SPEC_KEYS."""
        changes: dict[str, Any] = {}
        list_key = None
        for raw in (spec or "").split(","):
            item = raw.strip()
            if not item:
                continue
            if "=" not in item:
                if list_key is None:
                    raise ValueError(f"expected key=value, got {item!r} (keys: "
                                     f"{', '.join(SPEC_KEYS)})")
                changes[list_key] += _lengths(item)
                continue
            key, value = (s.strip() for s in item.split("=", 1))
            name = SPEC_KEYS.get(key.lower().replace("-", "_"))
            if name is None:
                raise ValueError(f"unknown side setting {key!r} (keys: {', '.join(SPEC_KEYS)})")
            list_key = None
            if name == "alongside":
                changes[name] = _lengths(value)
                list_key = name
            elif name in ("weights", "kernel_policy", "decode_matmul", "speculative",
                          "draft_model"):
                changes[name] = value
            elif name == "batch_invariant":
                changes[name] = value.lower() in ("1", "true", "yes", "on")
            else:
                try:
                    changes[name] = int(value)
                except ValueError:
                    raise ValueError(f"{key} must be a whole number, got {value!r}") from None
        if "alongside" in changes:
            changes["alongside"] = tuple(changes["alongside"])
        return replace(base or cls(), **changes)


SPEC_KEYS = {
    "weights": "weights", "policy": "kernel_policy", "kernel_policy": "kernel_policy",
    "threshold": "kernel_threshold", "kernel_threshold": "kernel_threshold",
    "alongside": "alongside", "join": "join_at", "join_at": "join_at",
    "others_tokens": "alongside_max_tokens", "alongside_max_tokens": "alongside_max_tokens",
    "max_batched": "max_num_batched_tokens", "max_num_batched_tokens": "max_num_batched_tokens",
    "max_seqs": "max_num_seqs", "max_num_seqs": "max_num_seqs", "block_size": "block_size",
    "batch_invariant": "batch_invariant", "matmul": "decode_matmul",
    "decode_matmul": "decode_matmul", "speculative": "speculative", "spec": "speculative",
    "k": "num_speculative_tokens", "num_speculative_tokens": "num_speculative_tokens",
    "draft": "draft_model", "draft_model": "draft_model",
}


def _lengths(text: str) -> list[int]:
    text = text.strip()
    if text.lower() in ("", "none", "alone"):
        return []
    out = []
    for part in text.replace("/", "+").split("+"):
        try:
            out.append(int(part))
        except ValueError:
            raise ValueError(f"alongside takes prompt lengths in tokens, got {part!r}") from None
    return out


# ---- one side's run ------------------------------------------------------------------------
@dataclass
class SideRun:
    side: SideConfig
    prompt_ids: list[int]
    finish: FinishEvent
    trace: list[dict]
    steps: list[dict]  # every step from the target's first to its last (relative numbering)
    others_joined: bool
    model: str
    weights: str  # as loaded ("auto" resolved)
    eos_ids: set[int] = field(default_factory=set)
    tokens: list[dict] = field(default_factory=list)  # the target's token events (runs database)
    # Every step the side's engine ran for this run, as StepRecord.to_dict() with the step
    # renumbered like `steps` (engine_step: the engine's own number): the runs database's steps.
    engine_steps: list[dict] = field(default_factory=list)
    request_ids: dict = field(default_factory=dict)  # {"target": id, "alongside": [ids]}
    engine_config: dict = field(default_factory=dict)  # the engine as it ran this side


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
            decode_matmul=side.decode_matmul, speculative=side.speculative,
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
            *, top_k: int = 5, chat: bool = False, ignore_eos: bool = True) -> dict:
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
        record.update(prompt=prompt if isinstance(prompt, str) else None, chat=chat,
                      max_tokens=max_tokens, ignore_eos=ignore_eos,
                      elapsed_s=round(time.perf_counter() - t0, 3), backend=_backend())
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


def _backend() -> dict:
    """Where the experiment ran; the BLAS by its library name (a record is shared and saved:
    it does not say where the library lives on this machine)."""
    from engine.platform import backend_info, blas_name

    info = backend_info()
    return info | {"blas": blas_name(info.get("blas"))}


# ---- comparison ----------------------------------------------------------------------------
def _token_logits(run: SideRun) -> list[tuple[np.ndarray, dict]]:
    """(logits, trace entry) for every token the target emitted, in order: one per sampled
    step, or one per emitted token of a verify step."""
    out = []
    for t in run.trace:
        logits = t["logits"]
        if logits is None:
            continue
        out.extend((row, t) for row in (logits if logits.ndim == 2 else [logits]))
    return out


def _chosen(run: SideRun) -> list[int]:
    """The token chosen at each sampled step: the output, plus a final EOS if it stopped on one."""
    ids = list(run.finish.token_ids)
    sampled = _token_logits(run)
    if len(sampled) > len(ids):
        ids.append(int(np.argmax(sampled[len(ids)][0])))
    return ids


def _margin(logits: np.ndarray) -> tuple[float, int, float]:
    """(top-1 minus top-2 logit, top-1 id, top-1 logit)."""
    top2 = np.argpartition(-logits, 1)[:2]
    first, second = sorted(top2, key=lambda i: -logits[i])
    return float(logits[first] - logits[second]), int(first), float(logits[first])


def _positions(run: SideRun) -> tuple[np.ndarray, list[int], int]:
    """Keys and values by position (last write wins), the trace entry that wrote each, and how
    many positions were written more than once (a preempted request recomputes its prefix)."""
    total = max(t["start"] + t["rows"] for t in run.trace)
    layers, two, heads, _, dim = run.trace[0]["kv"].shape
    kv = np.zeros((total, layers, two, heads, dim), dtype=np.float32)
    writer = [-1] * total
    rewrites = 0
    for i, t in enumerate(run.trace):
        lo, hi = t["start"], t["start"] + t["rows"]
        kv[lo:hi] = np.transpose(t["kv"], (3, 0, 1, 2, 4))
        rewrites += sum(1 for p in range(lo, hi) if writer[p] != -1)
        writer[lo:hi] = [i] * (hi - lo)
    return kv, writer, rewrites


def _writer(run: SideRun, index: int) -> dict | None:
    if index < 0:
        return None
    t = run.trace[index]
    step = next((s for s in run.steps if s["step"] == t["step"]), {})
    return {"step": t["step"], "path": t["path"], "step_rows": t["step_rows"],
            "phase": t["phase"], "start": t["start"], "rows": t["rows"],
            "prefill_rows": step.get("prefill_rows"), "decode_rows": step.get("decode_rows"),
            "requests": step.get("requests")}


def _describe_writer(w: dict | None) -> str:
    if w is None:
        return "—"
    return f"step {w['step']} ({w['path']}, {w['step_rows']} rows)"


def compare(a: SideRun, b: SideRun, decode: Callable[[list[int]], str], top_k: int = 5) -> dict:
    """The divergence record of two runs of the same prompt (JSON-ready: no arrays)."""
    prompt_len = len(a.prompt_ids)
    chosen_a, chosen_b = _chosen(a), _chosen(b)
    fork = next((i for i, (x, y) in enumerate(zip(chosen_a, chosen_b, strict=False))
                 if x != y), None)
    if fork is None and len(chosen_a) != len(chosen_b):
        fork = min(len(chosen_a), len(chosen_b))  # one side stopped earlier
    identical = fork is None and a.finish.token_ids == b.finish.token_ids

    # Logits, token by token, while both sides saw the same tokens (the fork's included).
    logits_a, logits_b = _token_logits(a), _token_logits(b)
    n_logits = min(len(logits_a), len(logits_b))
    if fork is not None:
        n_logits = min(n_logits, fork + 1)
    per_token = []
    for i in range(n_logits):
        (la, ta), (lb, tb) = logits_a[i], logits_b[i]
        margin_a, top_a, top_logit_a = _margin(la)
        margin_b, top_b, top_logit_b = _margin(lb)
        per_token.append({
            "index": i, "max_abs_delta": float(np.max(np.abs(la - lb))),
            "margin_a": margin_a, "margin_b": margin_b, "top1_a": top_a, "top1_b": top_b,
            "top1_logit_a": top_logit_a, "top1_logit_b": top_logit_b,
            "step_a": ta["step"], "step_b": tb["step"], "path_a": ta["path"],
            "path_b": tb["path"], "rows_a": ta["step_rows"], "rows_b": tb["step_rows"]})
    first_logit = next((p["index"] for p in per_token if p["max_abs_delta"] > 0), None)
    max_dlogit = max((p["max_abs_delta"] for p in per_token), default=0.0)
    min_margin = min(({"index": p["index"], "side": s, "value": p[f"margin_{s}"]}
                      for p in per_token for s in ("a", "b")),
                     key=lambda m: m["value"], default=None)

    # Keys and values, position by position, over the positions holding the same tokens.
    kv_a, writer_a, rewrites_a = _positions(a)
    kv_b, writer_b, rewrites_b = _positions(b)
    n_pos = min(len(writer_a), len(writer_b))
    if fork is not None:
        n_pos = min(n_pos, prompt_len + fork)  # position prompt+fork holds the differing token
    delta = np.abs(kv_a[:n_pos] - kv_b[:n_pos])
    by_position = delta.reshape(n_pos, -1).max(axis=1) if n_pos else np.zeros(0)
    per_layer = delta.max(axis=(0, 2, 3, 4)) if n_pos else np.zeros(0)
    nonzero = np.flatnonzero(by_position > 0)
    sequence = list(a.prompt_ids) + chosen_a
    kv_first = None
    if nonzero.size:
        p = int(nonzero[0])
        d = delta[p]
        kv_first = {
            "position": p, "token_id": int(sequence[p]), "in_prompt": p < prompt_len,
            "output_index": None if p < prompt_len else p - prompt_len,
            "a": _writer(a, writer_a[p]), "b": _writer(b, writer_b[p]),
            "max_abs_delta": float(by_position[p]),
            "keys_max_abs_delta": float(d[:, 0].max()),
            "values_max_abs_delta": float(d[:, 1].max()),
            "max_abs_delta_per_layer": [float(x) for x in d.max(axis=(1, 2, 3))]}
    segments = []
    for p in range(n_pos):
        key = (writer_a[p], writer_b[p])
        if segments and segments[-1]["_key"] == key:
            seg = segments[-1]
            seg["last"] = p
        else:
            seg = {"_key": key, "first": p, "last": p, "a": _writer(a, writer_a[p]),
                   "b": _writer(b, writer_b[p]), "max_abs_delta": 0.0, "first_difference": None}
            segments.append(seg)
        if by_position[p] > seg["max_abs_delta"]:
            seg["max_abs_delta"] = float(by_position[p])
        if by_position[p] > 0 and seg["first_difference"] is None:
            seg["first_difference"] = p
    for seg in segments:
        seg.pop("_key")

    text_a, text_b = a.finish.text, b.finish.text
    fork_record = None
    if fork is not None:
        char = common_prefix(text_a, text_b)
        fork_record = {
            "token_index": fork, "char_offset": char, "shared_text": text_a[:char],
            "continuation_a": text_a[char:], "continuation_b": text_b[char:],
            "token_a": chosen_a[fork] if fork < len(chosen_a) else None,
            "token_b": chosen_b[fork] if fork < len(chosen_b) else None,
            "text_a": decode([chosen_a[fork]]) if fork < len(chosen_a) else None,
            "text_b": decode([chosen_b[fork]]) if fork < len(chosen_b) else None,
            "margin_a": None, "margin_b": None, "step_a": None, "step_b": None, "table": []}
        if fork < n_logits:
            p = per_token[fork]
            fork_record.update(margin_a=p["margin_a"], margin_b=p["margin_b"],
                               step_a=p["step_a"], step_b=p["step_b"],
                               table=_fork_table(logits_a[fork][0], logits_b[fork][0], top_k,
                                                 decode))

    record = {
        "version": 1, "model": a.model, "prompt_ids": list(a.prompt_ids),
        "prompt_tokens": prompt_len,
        "sides": {"a": _side(a, chosen_a), "b": _side(b, chosen_b)},
        "identical": identical,
        "bit_identical": identical and max_dlogit == 0.0 and not nonzero.size,
        "fork": fork_record,
        "logits": {"compared_tokens": n_logits, "max_abs_delta": max_dlogit,
                   "first_difference": first_logit, "min_margin": min_margin,
                   "per_token": per_token},
        "kv": {"compared_positions": n_pos, "max_abs_delta": float(by_position.max(initial=0)),
               "max_abs_delta_per_layer": [float(x) for x in per_layer],
               "first_difference": kv_first, "by_position": [float(x) for x in by_position],
               "rewritten_positions": {"a": rewrites_a, "b": rewrites_b},
               "segments": segments},
    }
    record["verdict"] = _verdict(record)
    record["chain"] = _chain(record)
    return record


def _side(run: SideRun, chosen: list[int]) -> dict:
    return {"config": run.side.to_dict(), "label": run.side.label(), "model": run.model,
            "weights": run.weights, "token_ids": list(run.finish.token_ids),
            "text": run.finish.text, "finish_reason": run.finish.reason,
            "chosen": chosen, "others_joined": run.others_joined, "steps": run.steps,
            "tokens": run.tokens, "preemptions": run.finish.preemptions,
            "times": {"queued": run.finish.arrival_time,
                      "first_scheduled": run.finish.first_scheduled_time,
                      "first_token": run.finish.first_token_time,
                      "finished": run.finish.finish_time},
            "engine_steps": run.engine_steps, "request_ids": run.request_ids,
            "engine": run.engine_config, "speculation": _speculation(run)}


def _speculation(run: SideRun) -> dict | None:
    """The target's drafts over the run: proposed, accepted, the rate (None: not speculating)."""
    if run.side.speculative == "off":
        return None
    drafted = sum(s.get("target_drafted", 0) for s in run.steps)
    accepted = sum(s.get("target_accepted", 0) for s in run.steps)
    return {"method": run.side.speculative, "k": run.side.num_speculative_tokens,
            "draft_model": run.side.engine_draft_model,
            "verify_steps": sum(1 for s in run.steps if s.get("target_phase") == "verify"),
            "drafted": drafted, "accepted": accepted,
            "acceptance": accepted / drafted if drafted else None}


def _fork_table(la: np.ndarray, lb: np.ndarray, top_k: int,
                decode: Callable[[list[int]], str]) -> list[dict]:
    """The leading tokens of both sides with their logits (the mini-vllm-rs write-up's table)
    and logprobs."""
    k = max(1, min(top_k, la.shape[0]))
    ids = list(dict.fromkeys([*np.argsort(-la, kind="stable")[:k].tolist(),
                              *np.argsort(-lb, kind="stable")[:k].tolist()]))
    lse_a = _logsumexp(la)
    lse_b = _logsumexp(lb)
    rows = []
    for t in ids:
        xa, xb = float(la[t]), float(lb[t])
        rows.append({"token_id": int(t), "text": decode([int(t)]), "logit_a": xa, "logit_b": xb,
                     "delta": xb - xa, "logprob_a": xa - lse_a, "logprob_b": xb - lse_b,
                     "rank_a": int((la > la[t]).sum()) + 1, "rank_b": int((lb > lb[t]).sum()) + 1})
    rows.sort(key=lambda r: (r["rank_a"], r["rank_b"]))
    return rows


def _logsumexp(x: np.ndarray) -> float:
    x64 = x.astype(np.float64)
    m = float(x64.max())
    return m + float(np.log(np.exp(x64 - m).sum()))


def _verdict(r: dict) -> str:
    logits, kv = r["logits"], r["kv"]
    if r["bit_identical"]:
        return (f"bit-identical: the same {len(r['sides']['a']['token_ids'])} tokens; "
                f"max |Δlogit| = 0 over {logits['compared_tokens']} tokens and max |ΔKV| = 0 "
                f"over {kv['compared_positions']} positions")
    if r["identical"]:
        return (f"same tokens, different numbers: max |Δlogit| = {logits['max_abs_delta']:.3g}, "
                f"max |ΔKV| = {kv['max_abs_delta']:.3g}")
    f = r["fork"]
    return f"forked at output token {f['token_index']} (character {f['char_offset']})"


def _chain(r: dict) -> list[str]:
    """Cause to effect, one sentence each: KV -> logits -> fork."""
    out = []
    kv, logits, fork = r["kv"], r["logits"], r["fork"]
    first = kv["first_difference"]
    if first is None:
        out.append(f"KV identical at all {kv['compared_positions']} compared positions "
                   "(max |ΔKV| = 0)")
    else:
        where = ("prompt token" if first["in_prompt"]
                 else f"output token #{first['output_index']} fed back")
        out.append(f"KV first differs at position {first['position']} ({where}), written at "
                   f"{_describe_writer(first['a'])} on A vs {_describe_writer(first['b'])} on B; "
                   f"max |ΔKV| there {first['max_abs_delta']:.3g}")
    i = logits["first_difference"]
    if i is None:
        out.append(f"logits identical at all {logits['compared_tokens']} compared tokens "
                   "(max |Δlogit| = 0)")
    else:
        p = logits["per_token"][i]
        out.append(f"first logit difference at output token {i} (max |Δlogit| "
                   f"{p['max_abs_delta']:.3g}; step {p['step_a']} {p['path_a']} {p['rows_a']} "
                   f"rows on A, step {p['step_b']} {p['path_b']} {p['rows_b']} rows on B)")
    if fork is None:
        m = logits["min_margin"]
        tail = (f"; smallest top-2 margin {m['value']:.4g} at token {m['index']} (side "
                f"{m['side'].upper()})" if m else "")
        out.append(f"no fork in {len(r['sides']['a']['token_ids'])} tokens{tail}")
    else:
        margins = ""
        if fork["margin_a"] is not None:
            margins = f" (top-2 margin A {fork['margin_a']:.4g}, B {fork['margin_b']:.4g})"
        out.append(f"fork at output token {fork['token_index']}: A chose "
                   f"{fork['token_a']} {fork['text_a']!r}, B chose {fork['token_b']} "
                   f"{fork['text_b']!r}{margins}")
    return out


def timeline(record: dict) -> list[dict]:
    """The contamination segments, with runs of one-position decode steps that look alike on
    both sides (same paths and row counts) merged into one row, for printing."""
    rows: list[dict] = []
    for seg in record["kv"]["segments"]:
        a, b = seg["a"], seg["b"]
        look = (a and (a["path"], a["step_rows"], a["rows"]), b and (b["path"], b["step_rows"],
                                                                     b["rows"]))
        single = seg["first"] == seg["last"]
        prev = rows[-1] if rows else None
        if prev and single and prev["_single"] and prev["_look"] == look:
            prev["last"] = seg["last"]
            prev["steps_a"][1] = a["step"] if a else None
            prev["steps_b"][1] = b["step"] if b else None
            prev["count"] += 1
            prev["max_abs_delta"] = max(prev["max_abs_delta"], seg["max_abs_delta"])
            if prev["first_difference"] is None:
                prev["first_difference"] = seg["first_difference"]
            continue
        rows.append({**seg, "_look": look, "_single": single, "count": 1,
                     "steps_a": [a["step"] if a else None] * 2,
                     "steps_b": [b["step"] if b else None] * 2})
    for row in rows:
        row.pop("_look")
        row.pop("_single")
    return rows


# ---- entry points --------------------------------------------------------------------------
def run_experiment(prompt: str | list[int], a: SideConfig, b: SideConfig, max_tokens: int = 64,
                   loader: Loader = None, top_k: int = 5, progress: Progress = None, *,
                   model: str = "embedded", chat: bool = False, ignore_eos: bool = True) -> dict:
    """Run `prompt` greedily on side A and side B and return the divergence record.

    loader(weights) builds the model on the engine thread (tests: a tiny model); None loads
    `model` with the side's weights. EOS is ignored by default so both sides run max_tokens."""
    with DivergenceRunner(loader, model, progress) as runner:
        return runner.run(prompt, a, b, max_tokens, top_k=top_k, chat=chat,
                          ignore_eos=ignore_eos)


def load_prompts(path: str | Path) -> list[str]:
    """One prompt per line (blank lines skipped); a line that is a JSON string is decoded, so a
    prompt can hold newlines: "line one\\nline two"."""
    prompts = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        if line.startswith('"'):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                value = None
            if isinstance(value, str):
                line = value
        prompts.append(line)
    if not prompts:
        raise ValueError(f"no prompts in {path}")
    return prompts


def search(prompts: list[str] | None, a: SideConfig, b: SideConfig, max_tokens: int = 64,
           loader: Loader = None, top_k: int = 5, progress: Progress = None, *,
           model: str = "embedded", chat: bool = False, ignore_eos: bool = True,
           keep: int = 5) -> dict:
    """Run many prompts (None: BUILTIN_PROMPTS) on both sides: how often and where they fork,
    and the nearest ties seen. Full records are kept for the forks (the first `keep`)."""
    prompts = list(prompts or BUILTIN_PROMPTS)
    report = progress or (lambda message: None)
    results, forks, near = [], [], []
    t0 = time.perf_counter()
    with DivergenceRunner(loader, model, None) as runner:
        runner.reserve(prompts, [a, b], max_tokens, chat)
        for n, prompt in enumerate(prompts):
            report(f"[{n + 1}/{len(prompts)}] {prompt[:50]!r}")
            try:
                r = runner.run(prompt, a, b, max_tokens, top_k=top_k, chat=chat,
                               ignore_eos=ignore_eos)
            except (ValueError, EngineError) as e:
                results.append({"index": n, "prompt": prompt, "error": str(e)})
                report(f"    error: {e}")
                continue
            fork, logits, kv = r["fork"], r["logits"], r["kv"]
            m = logits["min_margin"]
            # A close call: the top-2 margin within 10x the logit noise between the sides.
            close = sum(1 for p in logits["per_token"] if p["max_abs_delta"] > 0
                        and min(p["margin_a"], p["margin_b"]) <= 10 * p["max_abs_delta"])
            results.append({
                "index": n, "prompt": prompt, "identical": r["identical"],
                "bit_identical": r["bit_identical"],
                "fork_index": fork["token_index"] if fork else None,
                "fork_margin_a": fork["margin_a"] if fork else None,
                "fork_margin_b": fork["margin_b"] if fork else None,
                "min_margin": m, "max_abs_dlogit": logits["max_abs_delta"],
                "tokens_compared": logits["compared_tokens"], "close_calls": close,
                "first_logit_difference": logits["first_difference"],
                "kv_first_difference": (kv["first_difference"]["position"]
                                        if kv["first_difference"] else None),
                "max_abs_dkv": kv["max_abs_delta"], "verdict": r["verdict"]})
            if m is not None:
                near.append({"prompt_index": n, "token_index": m["index"], "side": m["side"],
                             "margin": m["value"], "forked_here": bool(fork and
                                                                      fork["token_index"]
                                                                      == m["index"])})
            if fork and len(forks) < keep:
                forks.append(r)
            report(f"    {r['verdict']}")
    ok = [x for x in results if "error" not in x]
    return {
        "version": 1, "prompts": len(prompts), "max_tokens": max_tokens, "chat": chat,
        "a": a.to_dict(), "b": b.to_dict(),
        "forked": sum(1 for x in ok if x["fork_index"] is not None),
        "same_tokens_numbers_differ": sum(1 for x in ok if x["identical"]
                                          and not x["bit_identical"]),
        "bit_identical": sum(1 for x in ok if x["bit_identical"]),
        "errors": len(results) - len(ok),
        "fork_indices": [x["fork_index"] for x in ok if x["fork_index"] is not None],
        "tokens_compared": sum(x["tokens_compared"] for x in ok),
        "close_calls": sum(x["close_calls"] for x in ok),
        "smallest_margins": sorted(near, key=lambda m: m["margin"])[:10],
        "results": results, "forks": forks,
        "elapsed_s": round(time.perf_counter() - t0, 3), "backend": _backend()}
