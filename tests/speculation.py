"""Drafts that the tiny random model accepts and rejects, for the app's speculation tests
(ScriptedDrafts lives in engine.testing, beside the tiny model; re-exported here).

Prompt lookup rarely guesses right on random weights, so the app tests draft with a script: a
request's greedy continuation as a run without speculation found it on the same engine, with
the draft at every `wrong`-th output position changed, so steps keep some drafts and lose
others (as the engine tests' Oracle does, tests/engine/test_speculative.py)."""

from __future__ import annotations

from collections.abc import Sequence

from engine.telemetry import StepRecord
from engine.testing import ScriptedDrafts

__all__ = ["SPEC", "ScriptedDrafts", "verify_totals"]

# Speculation on for every step of these small tests (k drafts, up to 16 running requests).
SPEC = {"speculative": "ngram", "num_speculative_tokens": 4, "speculative_max_batch": 16}


def verify_totals(records: Sequence[StepRecord]) -> dict[str, int]:
    """What the step records say speculation did: groups, drafts, accepted, and per draft
    position the groups that kept more than that many drafts."""
    groups = [e for r in records for e in r.entries if e.phase == "verify" and e.sampled]
    k = max((e.drafted for e in groups), default=0)
    return {"groups": len(groups), "drafted": sum(e.drafted for e in groups),
            "accepted": sum(e.accepted for e in groups),
            "rejected": sum(e.drafted - e.accepted for e in groups),
            **{f"pos{i}": sum(1 for e in groups if e.accepted > i) for i in range(k)}}
