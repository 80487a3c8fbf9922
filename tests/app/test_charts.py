"""app/charts.py: ticks, scales, escaping of every string, empty and one-point charts, and that it
stays a leaf module."""

from __future__ import annotations

import ast
import math
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from app import charts
from app.charts import (
    Panel,
    Point,
    Scale,
    Series,
    Svg,
    ecdf,
    extent,
    line_chart,
    nice_ticks,
    tick_label,
)

NS = {"s": "http://www.w3.org/2000/svg"}
EVIL = '</text><script>alert("x")</script>&amp;'


def parse(text: str) -> ET.Element:
    return ET.fromstring(text)  # well-formed XML, or this raises


def chart(series: list[Series], **kw) -> ET.Element:
    return parse(line_chart("t", "x", "y", series, css_class="c", **kw))


# ---- ticks and scales ----------------------------------------------------------------------
@pytest.mark.parametrize("lo, hi, ticks", [
    (0, 10, [0, 2, 4, 6, 8, 10]),
    (0, 1, [0, 0.2, 0.4, 0.6, 0.8, 1.0]),
    (0, 47.3, [0, 10, 20, 30, 40]),
    (50 * 0.95, 150 * 1.05, [50, 100, 150]),
    (0, 0, [0]),  # no span: one tick, no division by zero
])
def test_nice_ticks_are_round_steps_within_the_range(lo, hi, ticks):
    got = nice_ticks(lo, hi, 4 if hi == 150 * 1.05 else 5)
    assert got == pytest.approx(ticks)
    assert all(lo - 1e-9 <= t <= hi + 1e-9 for t in got)


def test_tick_labels_are_short():
    assert [tick_label(v) for v in (0, 0.25, 2.0, 12345.0, 250000.0)] == \
        ["0", "0.25", "2", "12345", "2.5e+05"]


def test_extent_has_headroom_and_survives_zeros_and_nan():
    ticks, top = extent([40.0], 1.1)
    assert ticks == [0, 10, 20, 30, 40] and top == pytest.approx(44.0)
    for values in ([], [0.0, 0.0], [math.nan]):
        ticks, top = extent(values)
        assert top > 0 and ticks[0] == 0


def test_scales():
    linear = Scale(0, 10, 100, 200)
    assert (linear(0), linear(5), linear(10)) == (100, 150, 200)
    down = Scale(0, 1, 250, 36)  # y: larger values higher up
    assert down(1) < down(0.5) < down(0)
    log2 = Scale(1, 16, 0, 400, log=2)
    assert [log2(n) for n in (1, 2, 4, 8, 16)] == pytest.approx([0, 100, 200, 300, 400])
    log10 = Scale(1e-3, 1e1, 198, 12, log=10, floor=212)
    assert log10(1e-1) == pytest.approx(105)
    assert log10(0) == log10(-1) == log10(math.nan) == 212  # below the lowest decade
    assert Scale(4, 4, 100, 200, log=2)(4) == 150  # one value: the middle


# ---- escaping ------------------------------------------------------------------------------
def test_every_string_is_escaped():
    long = EVIL * 2  # a legend name past 40 characters
    series = [Series(long, [Point(1, 2, tip=EVIL, label=EVIL, attrs={"data_run": EVIL})],
                     marker=3, line_attrs={"data_name": EVIL})]
    text = line_chart(EVIL, EVIL, EVIL, series, css_class='c" onload="x')
    assert "<script>" not in text and 'onload="x"' not in text
    root = parse(text)
    assert root.get("class") == 'c" onload="x'  # one attribute, its quote escaped
    assert root.find("s:title", NS).text == EVIL
    shown = "".join(root.itertext())
    assert shown.count(EVIL) >= 4  # heading, axis labels, point label, tooltip
    (dot,) = root.findall(".//s:circle", NS)
    assert dot.get("data-run") == EVIL and dot.find("s:title", NS).text == EVIL
    assert root.find(".//s:polyline", NS).get("data-name") == EVIL
    legend = [t.text for t in root.findall("s:text", NS)]
    assert long[:40] in legend and long not in legend  # cut to 40 characters, then escaped


def test_control_characters_do_not_break_the_document():
    root = chart([Series("run\x1b[31m\x00", [(1, 1)])])  # a pasted terminal label
    assert "run\ufffd[31m\ufffd" in [t.text for t in root.findall("s:text", NS)]


# ---- empty and one point -------------------------------------------------------------------
def test_an_empty_chart_still_draws_its_axes_and_says_so():
    root = chart([Series("none", [])], empty="nothing yet")
    assert not root.findall(".//s:polyline", NS) and not root.findall(".//s:circle", NS)
    texts = [t.text for t in root.iter(f"{{{NS['s']}}}text")]
    assert "nothing yet" in texts and "none" in texts  # the note, and the legend entry
    assert "0" in texts and "1" in texts  # an axis from 0 to 1
    assert "nothing yet" not in line_chart("t", "x", "y", [], css_class="c", empty=None)
    assert "no data" in line_chart("t", "x", "y", [], css_class="c")


def test_one_point_is_a_dot_inside_the_frame():
    root = chart([Series("one", [Point(3, 7, tip="3: 7")], marker=4, joined=False)])
    (dot,) = root.findall(".//s:circle", NS)
    cx, cy = float(dot.get("cx")), float(dot.get("cy"))
    assert charts.LEFT < cx < charts.RIGHT and charts.TOP < cy < charts.BOTTOM
    assert not root.findall(".//s:polyline", NS)  # not joined: no line
    joined = chart([Series("one", [(3, 7)])])
    (line,) = joined.findall(".//s:polyline", NS)
    assert line.get("points") == f"{cx:.1f},{cy:.1f}"
    assert "nan" not in ET.tostring(joined, encoding="unicode")


def test_points_that_cannot_be_placed_are_left_out():
    root = chart([Series("s", [(1, 1), (2, math.nan), (3, math.inf), (4, 2)], marker=2)])
    assert len(root.findall(".//s:circle", NS)) == 2
    (line,) = root.findall(".//s:polyline", NS)
    assert len(line.get("points").split()) == 2


def test_series_colors_legend_and_fixed_y_ticks():
    root = chart([Series("a", [(1, 0.5)]), Series("b", [(2, 1.0)], color="#123456")],
                 y_ticks=[0, 0.5, 1.0])
    strokes = [p.get("stroke") for p in root.findall(".//s:polyline", NS)]
    assert strokes == [charts.PALETTE[0], "#123456"]
    legend = [ln.get("stroke") for ln in root.findall("s:line", NS) if ln.get("stroke-width")]
    assert legend == strokes
    labels = [t.text for t in root.findall("s:text", NS)]
    assert {"0", "0.5", "1"} <= set(labels)


def test_ecdf_steps_up_to_one():
    assert ecdf([]) == []
    pts = ecdf([3.0, 1.0, 2.0])  # sorted here
    assert pts[:2] == [(0.0, 0.0), (1.0, 0.0)]
    assert pts[-1] == (3.0, 1.0) and len(pts) == 2 + 2 * 3
    assert [y for _, y in pts] == sorted(y for _, y in pts)


def test_svg_builder_groups_marks_and_css_styling():
    svg = Svg(720, 240, css_class="div-chart", font_size=None, background=None, label="a & b")
    panel = Panel(56, 12, 708, 212, Scale(0, 9, 56, 708), Scale(1e-3, 10, 198, 12, log=10,
                                                                 floor=212))
    with svg.group(class_="threshold", data_threshold=2):
        svg.vline(100, 12, 212, "fork", tip="fork", class_="mark mark-fork")
    svg.series(panel, Series("d", [(0, 0.0), (9, 1.0)], width=None, marker=3,
                             line_attrs={"class_": "delta"}, dot_attrs={"class_": "dot"}))
    root = parse(svg.render())
    assert root.get("aria-label") == "a & b" and root.get("font-size") is None
    assert root.find("s:rect", NS) is None  # no background: the page's
    group = root.find("s:g", NS)
    assert group.get("data-threshold") == "2"
    assert group.find("s:line", NS).get("class") == "mark mark-fork"
    line = root.find("s:polyline", NS)
    assert line.get("class") == "delta" and line.get("stroke") is None  # styled by CSS
    assert [c.get("cy") for c in root.findall("s:circle", NS)] == ["212", "58.5"]


# ---- a leaf module -------------------------------------------------------------------------
def test_charts_imports_nothing_from_the_app_or_the_engine():
    tree = ast.parse(Path(charts.__file__).read_text(encoding="utf-8"))
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not {n for n in names if n.split(".")[0] in ("app", "engine")}, names
