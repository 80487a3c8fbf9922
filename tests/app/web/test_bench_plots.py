"""The /benchmarks SVG plots: drawn from the recorded numbers, strings escaped."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from app.web.pages.benchmark_plots import (
    latency_cdf_svg,
    latency_values,
    sweep_name,
    throughput_svg,
)

NS = {"s": "http://www.w3.org/2000/svg"}
EVIL = "</text><script>alert(1)</script>"


def run(id_, conc, tps, url="http://h:1", label=None, max_tokens_cap=None, requests=()):
    return {"id": id_, "label": label, "url": url, "endpoint": "completions",
            "dataset": "mixed", "num_prompts": 16, "config": {"max_tokens_cap": max_tokens_cap},
            "summary": {"peak_concurrency": conc, "output_throughput": tps},
            "requests": list(requests)}


def test_throughput_points_and_sweeps():
    runs = [run(1, 1, 10.0), run(2, 4, 30.0), run(3, 8, 45.0),
            run(4, 4, 20.0, max_tokens_cap=32), run(5, 2, 5.0, url="http://other:2")]
    svg = ET.fromstring(throughput_svg(runs))  # well-formed XML
    circles = svg.findall(".//s:circle", NS)
    assert sorted(c.get("data-run") for c in circles) == ["1", "2", "3", "4", "5"]
    # Only runs 1-3 share a workload and server: one joining line, through three points.
    lines = svg.findall(".//s:polyline", NS)
    assert len(lines) == 1 and len(lines[0].get("points").split()) == 3
    # Higher throughput is drawn higher (smaller y).
    y = {c.get("data-run"): float(c.get("cy")) for c in circles}
    assert y["3"] < y["2"] < y["1"]
    names = [sweep_name(r) for r in runs]
    assert names[0] == names[1] == names[2]  # one sweep
    assert len({names[0], names[3], names[4]}) == 3  # a length cap, another server: two more


def test_cdf_uses_successful_requests_only_and_escapes_labels():
    reqs = [{"success": True, "ttft": 0.1, "latency": 1.0},
            {"success": True, "ttft": 0.3, "latency": 2.0},
            {"success": False, "ttft": None, "latency": None, "error": "x"},
            {"success": True, "ttft": 0.2, "latency": 1.5}]
    r = run(7, 2, 1.0, label=EVIL, requests=reqs)
    assert latency_values(r, "ttft") == [100.0, 200.0, 300.0]
    text = latency_cdf_svg([r], "ttft", "TTFT")
    assert "<script>" not in text
    svg = ET.fromstring(text)
    (line,) = svg.findall(".//s:polyline", NS)
    assert line.get("data-n") == "3"
    # Two points per step plus the start: the curve ends at the top of the plot.
    points = [tuple(map(float, p.split(","))) for p in line.get("points").split()]
    assert len(points) == 2 + 2 * 3
    assert points[-1][1] < points[0][1]
    assert EVIL in "".join(svg.itertext())  # shown as text, escaped in the markup


def test_empty_plots_still_draw():
    assert "no runs" in throughput_svg([])
    assert "no successful requests" in latency_cdf_svg([run(1, 1, 1.0)], "ttft", "TTFT")
