"""Serving metrics from per-request timings, as `vllm bench serve` defines them.

Per request (times in seconds from the benchmark's start):
    TTFT  first output text received - request sent
    E2EL  stream finished - request sent
    TPOT  (E2EL - TTFT) / (output tokens - 1), only with at least 2 output tokens
    ITL   the gaps between successive chunks of output text (one per chunk after the first)

Failed requests count as failed and hold a concurrency slot while they last, but take no part in
latency statistics, token totals or throughput. Percentiles interpolate linearly between
samples (numpy's default). Statistics are reported in milliseconds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from app.stats import percentile

PERCENTILES = (50, 90, 99)
METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_TITLES = {"ttft": ("TTFT", "Time to First Token"),
                 "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
                 "itl": ("ITL", "Inter-token Latency"),
                 "e2el": ("E2EL", "End-to-end Latency")}


@dataclass
class RequestResult:
    """One request's outcome. Times are seconds since the benchmark started."""

    index: int
    input_len: int  # the dataset's estimate (words)
    max_tokens: int
    start: float
    end: float | None = None  # when it finished or failed
    success: bool = False
    error: str | None = None
    ttft: float | None = None  # seconds after start
    itl: list[float] = field(default_factory=list)
    chunks: int = 0  # chunks that carried output text
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    prompt_tokens_source: str = "estimate"  # usage | estimate
    output_tokens_source: str = "chunks"  # usage | chunks
    finish_reason: str | None = None
    # Tokens the server's usage reported, kept even when it disagrees with the chunk count.
    usage: dict | None = None
    # With --json-schema: whether the output parsed as JSON (None: no schema was sent).
    parsed: bool | None = None

    @property
    def latency(self) -> float | None:
        return self.end - self.start if self.success and self.end is not None else None

    @property
    def tpot(self) -> float | None:
        n = self.output_tokens or 0
        if not self.success or n < 2 or self.ttft is None or self.latency is None:
            return None
        return (self.latency - self.ttft) / (n - 1)

    def to_dict(self) -> dict:
        return {**asdict(self), "latency": self.latency, "tpot": self.tpot}

    @classmethod
    def from_dict(cls, d: Mapping) -> RequestResult:
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in names})


def stats(values_s: Sequence[float], percentiles: Iterable[int] = PERCENTILES) -> dict:
    """mean, median, std and percentiles in milliseconds; None values when there are none."""
    percentiles = tuple(percentiles)
    out: dict = {"count": len(values_s)}
    if not values_s:
        out.update({"mean_ms": None, "median_ms": None, "std_ms": None})
        out.update({f"p{p}_ms": None for p in percentiles})
        return out
    a = np.asarray(values_s, dtype=float) * 1000.0
    out.update({"mean_ms": float(a.mean()), "median_ms": float(np.median(a)),
                "std_ms": float(a.std())})
    out.update({f"p{p}_ms": percentile(a, p) for p in percentiles})
    return out


def peak_concurrency(results: Iterable[RequestResult]) -> int:
    """The most requests in flight at once (a request ending as another starts: not both)."""
    events = []
    for r in results:
        if r.end is None:
            continue
        events.append((r.start, 1))
        events.append((r.end, -1))
    events.sort(key=lambda e: (e[0], e[1]))  # ends before starts at equal times
    peak = current = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """["ttft:200", "tpot:50"] -> {"ttft": 200.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or ():
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput takes NAME:MILLISECONDS with NAME one of ttft, tpot, "
                             f"e2el; got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {name}: {value!r} is not a number of "
                             "milliseconds") from None
        if not ms > 0:
            raise ValueError(f"--goodput {name}: the limit must be positive, got {value}")
        slos[name] = ms
    return slos


def meets_slos(r: RequestResult, slos: Mapping[str, float]) -> bool:
    """A successful request within every given limit. A request with one output token has no
    TPOT and cannot miss a TPOT limit."""
    if not r.success:
        return False
    values = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.latency}
    for name, limit_ms in slos.items():
        v = values[name]
        if v is None:
            if name == "tpot":
                continue
            return False
        if v * 1000.0 > limit_ms:
            return False
    return True


def summarize(results: Sequence[RequestResult], duration: float,
              slos: Mapping[str, float] | None = None,
              percentiles: Iterable[int] = PERCENTILES) -> dict:
    """The report's numbers (JSON-ready)."""
    percentiles = tuple(percentiles)
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_tokens or 0 for r in ok)
    total_out = sum(r.output_tokens or 0 for r in ok)

    def per(n: float) -> float | None:
        return n / duration if duration > 0 else None

    summary: dict = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": per(len(ok)),
        "output_throughput": per(total_out),
        "total_token_throughput": per(total_in + total_out),
        "peak_concurrency": peak_concurrency(results),
        "ttft": stats([r.ttft for r in ok if r.ttft is not None], percentiles),
        "tpot": stats([t for r in ok if (t := r.tpot) is not None], percentiles),
        "itl": stats([g for r in ok for g in r.itl], percentiles),
        "e2el": stats([r.latency for r in ok if r.latency is not None], percentiles),
        "output_tokens_source": _count(r.output_tokens_source for r in ok),
        "input_tokens_source": _count(r.prompt_tokens_source for r in ok),
        "goodput": None,
        "json_parsed": None,
    }
    asked = [r for r in ok if r.parsed is not None]
    if asked:
        summary["json_parsed"] = {"parsed": sum(r.parsed for r in asked), "of": len(asked)}
    if slos:
        good = sum(1 for r in ok if meets_slos(r, slos))
        summary["goodput"] = {"slos_ms": dict(slos), "good_requests": good,
                              "request_goodput": per(good)}
    return summary


def _count(values: Iterable[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def _num(v: float | None, digits: int = 2) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def format_report(summary: Mapping, *, request_rate: float | None,
                  max_concurrency: int | None, percentiles: Iterable[int] = PERCENTILES) -> str:
    """The text report, laid out like `vllm bench serve`'s."""
    w = 50

    def line(label: str, value: object) -> str:
        return f"{label:<40}{value}"

    def rule(title: str, ch: str = "-") -> str:
        return f"{title:{ch}^{w}}"

    rate = "inf" if request_rate is None else f"{request_rate:g}"
    out = [rule(" Serving Benchmark Result ", "="),
           line("Successful requests:", summary["completed"]),
           line("Failed requests:", summary["failed"]),
           line("Maximum request concurrency:",
                "unlimited" if max_concurrency is None else max_concurrency),
           line("Request rate configured (RPS):", rate),
           line("Benchmark duration (s):", _num(summary["duration_s"])),
           line("Total input tokens:", summary["total_input_tokens"]),
           line("Total generated tokens:", summary["total_output_tokens"]),
           line("Request throughput (req/s):", _num(summary["request_throughput"])),
           line("Output token throughput (tok/s):", _num(summary["output_throughput"])),
           line("Peak concurrent requests:", summary["peak_concurrency"]),
           line("Total token throughput (tok/s):", _num(summary["total_token_throughput"]))]
    goodput = summary.get("goodput")
    if goodput:
        slos = ", ".join(f"{k} <= {v:g} ms" for k, v in goodput["slos_ms"].items())
        out.append(line("Request goodput (req/s):", _num(goodput["request_goodput"])))
        out.append(line("  good requests:", f"{goodput['good_requests']} ({slos})"))
    parsed = summary.get("json_parsed")
    if parsed:
        out.append(line("Outputs parsed as JSON:", f"{parsed['parsed']} of {parsed['of']}"))
    for metric in METRICS:
        short, title = METRIC_TITLES[metric]
        s = summary[metric]
        out.append(rule(title))
        out.append(line(f"Mean {short} (ms):", _num(s["mean_ms"])))
        out.append(line(f"Median {short} (ms):", _num(s["median_ms"])))
        for p in percentiles:
            if p == 50:
                continue
            out.append(line(f"P{p} {short} (ms):", _num(s.get(f"p{p}_ms"))))
    out.append("=" * w)
    sources = summary.get("output_tokens_source") or {}
    if sources:
        said = {"usage": "the server's usage", "chunks": "streamed chunks (no usage given)"}
        parts = [f"{said.get(k, k)} for {n}" for k, n in sorted(sources.items())]
        out.append("Output tokens counted from " + ", ".join(parts) + " requests")
    if summary["input_tokens_source"].get("estimate"):
        out.append("Input tokens: the server gave no usage for "
                   f"{summary['input_tokens_source']['estimate']} requests; their prompt "
                   "lengths are word counts")
    return "\n".join(out)
