"""Serving metrics (TTFT, TPOT, ITL, E2E, percentiles, goodput, peak concurrency) against
values computed by hand on synthetic timings."""

from __future__ import annotations

import pytest

from app.bench.metrics import (
    RequestResult,
    format_report,
    meets_slos,
    parse_goodput,
    peak_concurrency,
    stats,
    summarize,
)


def ok(index, start, end, ttft, out, prompt=10, itl=()):
    return RequestResult(index=index, input_len=prompt, max_tokens=out, start=start, end=end,
                         success=True, ttft=ttft, itl=list(itl), chunks=out,
                         prompt_tokens=prompt, output_tokens=out,
                         prompt_tokens_source="usage", output_tokens_source="usage")


def failed(index, start, end, error="HTTP 500: boom"):
    return RequestResult(index=index, input_len=10, max_tokens=5, start=start, end=end,
                         error=error)


def test_stats_interpolates_percentiles_linearly_in_ms():
    s = stats([0.1, 0.4, 0.2, 0.3])
    assert s["count"] == 4
    assert s["mean_ms"] == pytest.approx(250.0)
    assert s["median_ms"] == pytest.approx(250.0)
    # sorted 100, 200, 300, 400: rank 0.9 * 3 = 2.7 -> 300 + 0.7 * 100
    assert s["p90_ms"] == pytest.approx(370.0)
    assert s["p99_ms"] == pytest.approx(397.0)
    assert s["std_ms"] == pytest.approx(111.80339887)


def test_stats_of_nothing_are_none():
    s = stats([])
    assert s["count"] == 0 and s["mean_ms"] is None and s["p99_ms"] is None


def test_tpot_excludes_the_first_token_and_needs_two_tokens():
    r = ok(0, start=1.0, end=2.0, ttft=0.2, out=5)
    assert r.latency == pytest.approx(1.0)
    assert r.tpot == pytest.approx((1.0 - 0.2) / 4)
    assert ok(1, 1.0, 1.3, 0.3, out=1).tpot is None  # one output token: no TPOT
    assert failed(2, 0.0, 0.5).tpot is None and failed(2, 0.0, 0.5).latency is None


def test_peak_concurrency_counts_overlaps_not_touching_intervals():
    rs = [ok(0, 0.0, 1.0, 0.1, 2), ok(1, 0.5, 2.0, 0.1, 2), ok(2, 1.0, 3.0, 0.1, 2),
          ok(3, 2.5, 2.6, 0.1, 2)]
    # [0,1) and [0.5,2) overlap (2); the third starts as the first ends; 2.5-2.6 overlaps
    # only the third.
    assert peak_concurrency(rs) == 2
    assert peak_concurrency(rs + [failed(4, 0.6, 0.9)]) == 3  # failures hold a slot too
    assert peak_concurrency([]) == 0


def test_summary_counts_failures_but_keeps_them_out_of_latencies_and_totals():
    rs = [ok(0, 0.0, 1.0, 0.2, 5, prompt=10, itl=[0.2, 0.2, 0.2, 0.2]),
          ok(1, 0.5, 1.5, 0.4, 3, prompt=20, itl=[0.3, 0.3]),
          ok(2, 1.0, 1.1, 0.1, 1, prompt=30),
          failed(3, 0.0, 0.05)]
    s = summarize(rs, duration=2.0)
    assert (s["completed"], s["failed"]) == (3, 1)
    assert s["total_input_tokens"] == 60 and s["total_output_tokens"] == 9
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(4.5)
    assert s["total_token_throughput"] == pytest.approx(34.5)
    assert s["ttft"]["count"] == 3 and s["ttft"]["mean_ms"] == pytest.approx(700 / 3)
    # TPOT: (1.0 - 0.2) / 4 = 0.2 and (1.0 - 0.4) / 2 = 0.3; the 1-token request has none.
    assert s["tpot"]["count"] == 2 and s["tpot"]["mean_ms"] == pytest.approx(250.0)
    assert s["itl"]["count"] == 6 and s["itl"]["mean_ms"] == pytest.approx(1400 / 6)
    assert s["e2el"]["median_ms"] == pytest.approx(1000.0)
    assert s["e2el"]["mean_ms"] == pytest.approx(700.0)
    # [0, 1) with the failure [0, 0.05), then with [0.5, 1.5); [1.0, 1.1) starts as [0, 1) ends
    assert s["peak_concurrency"] == 2
    assert s["goodput"] is None
    assert s["output_tokens_source"] == {"usage": 3}


def test_goodput_needs_every_slo_and_a_single_token_passes_tpot():
    rs = [ok(0, 0.0, 1.0, 0.2, 5),  # ttft 200 ms, tpot 200 ms, e2el 1000 ms
          ok(1, 0.0, 0.5, 0.45, 1),  # ttft 450 ms, no tpot, e2el 500 ms
          ok(2, 0.0, 2.0, 0.1, 11),  # ttft 100 ms, tpot 190 ms, e2el 2000 ms
          failed(3, 0.0, 0.1)]
    slos = parse_goodput(["ttft:300", "tpot:195"])
    assert [meets_slos(r, slos) for r in rs] == [False, False, True, False]
    assert meets_slos(rs[1], {"tpot": 1.0}) is True
    s = summarize(rs, duration=4.0, slos={"e2el": 1500.0})
    assert s["goodput"] == {"slos_ms": {"e2el": 1500.0}, "good_requests": 2,
                            "request_goodput": pytest.approx(0.5)}


@pytest.mark.parametrize("bad", ["ttft", "latency:5", "ttft:abc", "tpot:0", "e2el:-3"])
def test_parse_goodput_rejects_bad_items(bad):
    with pytest.raises(ValueError, match="goodput"):
        parse_goodput([bad])


def test_report_shows_the_numbers_and_the_token_source():
    rs = [ok(0, 0.0, 1.0, 0.2, 5), failed(1, 0.0, 0.1)]
    rs.append(RequestResult(index=2, input_len=7, max_tokens=4, start=0.0, end=0.6,
                            success=True, ttft=0.1, chunks=3, prompt_tokens=7,
                            output_tokens=3))  # no usage: counted from chunks, estimated input
    text = format_report(summarize(rs, 2.0, {"ttft": 150.0}), request_rate=None,
                         max_concurrency=4)
    lines = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    values = {k.strip(): v.strip() for k, v in lines.items()}
    assert values["Successful requests"] == "2"
    assert values["Failed requests"] == "1"
    assert values["Maximum request concurrency"] == "4"
    assert values["Request rate configured (RPS)"] == "inf"
    assert values["Total input tokens"] == "17"
    assert values["Total generated tokens"] == "8"
    assert values["Output token throughput (tok/s)"] == "4.00"
    assert values["Request goodput (req/s)"] == "0.50"  # only the 100 ms TTFT is within 150
    assert values["Median TTFT (ms)"] == "150.00"
    assert values["P99 E2EL (ms)"] == "996.00"  # 600 and 1000 ms
    assert "the server's usage for 1" in text and "streamed chunks" in text
    assert "word counts" in text


def test_round_trip_through_dict_keeps_derived_values():
    r = ok(0, 1.0, 2.0, 0.2, 5, itl=[0.1])
    d = r.to_dict()
    assert d["tpot"] == pytest.approx(0.2) and d["latency"] == pytest.approx(1.0)
    assert RequestResult.from_dict(d) == r
