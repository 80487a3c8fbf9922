"""A step's plan as fixed-layout int32 arrays, broadcast from rank 0 to every rank.

Rank 0 encodes the step's RowGroups (and its kernel path) into one int32 array: a header of
HEADER words (kind, path, group count, payload length), then the payload. The broadcast is an
all_sum with zeros on the other ranks, and every rank must issue collectives of the same
shapes, so it goes in two parts whose shapes every rank knows: first a frame of FRAME words
(the header and as much payload as fits: a step of a few dozen decode rows needs no more),
then, only where the header says the payload is longer, the rest in one array of exactly that
length. Floats travel as the two int32 words of their float64 bits: exact.

What a group carries is what every rank's runner reads of it: tokens, start, block table,
sample / trace / phase, output_index, the recurrent-state fields, and the sampling inputs of
its params (temperature, top_p, top_k, min_p, seed, logprobs). The scheduler's Sequence (and
with it the logits processors: penalties, logit bias, grammars) stays on rank 0, which alone
samples what the engine emits; the other ranks' samples are discarded.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from engine.config import KernelPath
from engine.sampling import SamplingParams
from engine.scheduler import Phase, RowGroup

HEADER = 8  # words: MAGIC, kind, path, groups, payload length, nap (ms), 2 spare (zero)
FRAME = 1024  # words in the first broadcast (4 KiB): header + the payload's head
MAGIC = 0x7B5C0001  # the layout's version: a rank on another layout fails loudly
STEP, STOP, SLEEP = 1, 2, 3
_PATHS = (KernelPath.GEMM, KernelPath.GEMV, KernelPath.TILED)
_PHASES = tuple(Phase)
_INT64 = 2**63
# Per-group fixed words: flags, phase, start, output_index, state_slot, restore_from, then the
# lengths of tokens, block table, snapshots, checkpoints and the seq_id's UTF-8 bytes.
_SAMPLE, _TRACE, _PARAMS, _SLOT, _RESTORE, _SEED = (1 << i for i in range(6))


@dataclass
class Plan:
    """A decoded plan: the groups and path of a step, or a stop or a sleep (groups empty)."""

    stop: bool
    groups: list[RowGroup]
    path: KernelPath = KernelPath.GEMM
    sleep: bool = False  # no step: block on the doorbell until rank 0 rings it, or nap
    nap_s: float = 0.0  # a sleep without a doorbell: this long, then the next broadcast


class PlanError(ValueError):
    """A group the plan cannot carry exactly (named), or a frame of another layout."""


def encode(groups: list[RowGroup], path: str = KernelPath.GEMM) -> np.ndarray:
    """The plan of a step (header + payload, int32)."""
    path = KernelPath(path)
    if path not in _PATHS:
        raise PlanError(f"kernel path {path.value!r} is not a step's policy path")
    out: list[int] = []
    for g in groups:
        _encode_group(g, out)
    return _framed(STEP, _PATHS.index(path), len(groups), out)


def encode_stop() -> np.ndarray:
    """The plan that ends every worker's loop."""
    return _framed(STOP, 0, 0, [])


def encode_sleep(nap_ms: int = 0) -> np.ndarray:
    """The plan after which every worker blocks on its doorbell until the next plan; or,
    nap_ms > 0 (ranks without a doorbell), sleeps that long and joins the next broadcast."""
    return _framed(SLEEP, 0, 0, [], nap_ms)


def decode(words: np.ndarray) -> Plan:
    """The plan encoded in `words` (header + payload), on any rank."""
    header = words[:HEADER]
    if int(header[0]) != MAGIC:
        raise PlanError(f"not a plan of this layout (first word {int(header[0]):#x})")
    kind, path, n_groups, length, nap_ms = (int(v) for v in header[1:6])
    if kind in (STOP, SLEEP):
        return Plan(kind == STOP, [], sleep=kind == SLEEP, nap_s=nap_ms / 1000)
    if kind != STEP or len(words) != HEADER + length:
        raise PlanError(f"a malformed plan (kind {kind}, {len(words)} words for {length})")
    reader = _Reader(words[HEADER:])
    groups = [_decode_group(reader) for _ in range(n_groups)]
    if reader.at != length:
        raise PlanError(f"the plan's payload has {length - reader.at} words left over")
    return Plan(False, groups, _PATHS[path])


def broadcast(group: mx.distributed.Group, plan: np.ndarray | None = None) -> np.ndarray:
    """Rank 0 passes its encoded plan, the other ranks None; every rank gets the plan's words.
    Two all_sums at most, of shapes every rank knows (the frame, then the rest if any)."""
    root = group.rank() == 0
    if root and plan is None:
        raise ValueError("rank 0 broadcasts a plan")
    frame = np.zeros(FRAME, np.int32)
    if root:
        frame[:min(FRAME, len(plan))] = plan[:FRAME]
    frame = _all_sum(frame, group)
    total = HEADER + int(frame[4])
    if total <= FRAME:
        return frame[:total]
    rest = plan[FRAME:] if root else np.zeros(total - FRAME, np.int32)
    return np.concatenate([frame, _all_sum(rest, group)])


def _all_sum(words: np.ndarray, group: mx.distributed.Group) -> np.ndarray:
    # On the CPU stream: where collectives run on every backend but NCCL.
    out = mx.distributed.all_sum(mx.array(words), group=group, stream=mx.cpu)
    return np.array(out)


def _framed(kind: int, path: int, n_groups: int, payload: list[int],
            nap_ms: int = 0) -> np.ndarray:
    header = [MAGIC, kind, path, n_groups, len(payload), nap_ms, 0, 0]
    return np.array(header + payload, np.int64).astype(np.int32)


def _float_words(x: float) -> list[int]:
    return np.array([x], np.float64).view(np.int32).tolist()


def _encode_group(g: RowGroup, words: list[int]) -> None:
    out: list[int] = []
    seq_id = g.seq_id.encode("utf-8")
    p = g.params
    flags = ((_SAMPLE if g.sample else 0) | (_TRACE if g.trace else 0)
             | (_PARAMS if p is not None else 0)
             | (_SLOT if g.state_slot is not None else 0)
             | (_RESTORE if g.restore_from is not None else 0)
             | (_SEED if p is not None and p.seed is not None else 0))
    out += [flags, _PHASES.index(g.phase), g.start, g.output_index, g.state_slot or 0,
            g.restore_from or 0, len(g.token_ids), len(g.block_table), len(g.snapshots),
            len(g.checkpoints), len(seq_id)]
    out += g.token_ids
    out += g.block_table
    out += [v for pair in (*g.snapshots, *g.checkpoints) for v in pair]
    padded = seq_id + b"\0" * (-len(seq_id) % 4)
    out += np.frombuffer(padded, np.int32).tolist()
    if p is not None:
        seed = p.seed or 0
        if not -_INT64 <= seed < _INT64:
            raise PlanError(f"{g.seq_id}: seed {seed} does not fit 64 bits")
        out += [p.top_k, p.logprobs, *np.array([seed], np.int64).view(np.int32).tolist()]
        for x in (p.temperature, p.top_p, p.min_p):
            out += _float_words(float(x))
    if any(not -2**31 <= v < 2**31 for v in out):
        raise PlanError(f"{g.seq_id}: a value does not fit 32 bits")
    words += out


class _Reader:
    def __init__(self, words: np.ndarray):
        self.words, self.at = words, 0

    def take(self, n: int) -> np.ndarray:
        if self.at + n > len(self.words):
            raise PlanError("the plan's payload ends early")
        part = self.words[self.at:self.at + n]
        self.at += n
        return part

    def ints(self, n: int) -> list[int]:
        return self.take(n).tolist()

    def pairs(self, n: int) -> list[tuple[int, int]]:
        flat = self.ints(2 * n)
        return list(zip(flat[::2], flat[1::2], strict=True))

    def float(self) -> float:
        return float(self.take(2).view(np.float64)[0])


def _decode_group(r: _Reader) -> RowGroup:
    (flags, phase, start, output_index, slot, restore, n_tokens, n_blocks, n_snapshots,
     n_checkpoints, id_len) = r.ints(11)
    tokens, table = r.ints(n_tokens), r.ints(n_blocks)
    snapshots, checkpoints = r.pairs(n_snapshots), r.pairs(n_checkpoints)
    seq_id = r.take(-(-id_len // 4)).tobytes()[:id_len].decode("utf-8")
    params = None
    if flags & _PARAMS:
        top_k, logprobs = r.ints(2)
        seed = int(r.take(2).view(np.int64)[0])
        temperature, top_p, min_p = r.float(), r.float(), r.float()
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k,
                                seed=seed if flags & _SEED else None, logprobs=logprobs,
                                min_p=min_p)
    return RowGroup(seq_id, tokens, start, table, bool(flags & _SAMPLE), params, output_index,
                    trace=bool(flags & _TRACE), phase=_PHASES[phase],
                    state_slot=slot if flags & _SLOT else None,
                    restore_from=restore if flags & _RESTORE else None,
                    snapshots=snapshots, checkpoints=checkpoints)
