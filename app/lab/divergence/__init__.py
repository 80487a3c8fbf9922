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

The modules: sides (SideConfig and its mini-language), runner (the engines, one side's run,
run_experiment), compare (two runs -> the record), record (the typed record, to_dict/from_dict
of its JSON), report (verdict, chain, timeline, the page's view), text (the terminal's text),
search (many prompts).
"""

from __future__ import annotations

from app.lab.divergence.compare import SideRun, compare
from app.lab.divergence.record import DivergenceRecord, SearchSummary
from app.lab.divergence.report import timeline
from app.lab.divergence.runner import DivergenceRunner, run_experiment
from app.lab.divergence.search import BUILTIN_PROMPTS, load_prompts, search
from app.lab.divergence.sides import SideConfig

__all__ = ["BUILTIN_PROMPTS", "DivergenceRecord", "DivergenceRunner", "SearchSummary",
           "SideConfig", "SideRun", "compare", "load_prompts", "run_experiment", "search",
           "timeline"]
