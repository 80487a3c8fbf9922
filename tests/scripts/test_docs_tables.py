"""The docs carry the benchmarks' results tables as copies that scripts/docs_tables.py keeps."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "docs_tables.py"
_spec = importlib.util.spec_from_file_location("batchscope_docs_tables", _SCRIPT)
docs_tables = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = docs_tables
_spec.loader.exec_module(docs_tables)

RESULTS = """# A benchmark

`benchmarks/x.py`, run 2026-12-02: backend cpu.

| rows | tok/s |
|---|---|
| 1 | 24.2 |

![plot](x.svg)

## Serving

### 8 streams

| server | tok/s |
|---|---|
| batchscope | 90.0 |
"""


def _tree(tmp_path: Path, doc: str) -> Path:
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "x.md").write_text(RESULTS)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "bench.md").write_text(doc)
    return tmp_path / "docs" / "bench.md"


def test_the_docs_carry_their_results_files_as_they_are():
    # Fails when a table in README.md or docs/*.md was edited by hand or its results file was
    # rewritten by a benchmark without `.venv/bin/python scripts/docs_tables.py` after it.
    assert docs_tables.main(["--check"]) == 0
    included = [d.name for d in docs_tables.docs(docs_tables.ROOT)
                if "<!-- results: " in d.read_text()]
    assert {"README.md", "benchmarks.md"} <= set(included)


def test_a_copy_is_the_file_less_its_title_with_headings_and_links_moved(tmp_path, capsys):
    doc = _tree(tmp_path, "## Speed\n\n<!-- results: benchmarks/results/x.md -->\n"
                          "<!-- /results -->\n\nAfter.\n")
    assert docs_tables.main(["--check"], root=tmp_path) == 1
    assert "docs/bench.md: differs from benchmarks/results/x.md" in capsys.readouterr().err
    assert docs_tables.main([], root=tmp_path) == 0
    text = doc.read_text()
    assert "# A benchmark" not in text
    assert "\n| 1 | 24.2 |\n" in text
    assert "![plot](../benchmarks/results/x.svg)" in text
    assert "\n### Serving\n\n#### 8 streams\n" in text
    assert text.endswith("| batchscope | 90.0 |\n\n<!-- /results -->\n\nAfter.\n")
    assert docs_tables.main(["--check"], root=tmp_path) == 0


def test_a_retyped_figure_fails_the_check(tmp_path, capsys):
    doc = _tree(tmp_path, "<!-- results: benchmarks/results/x.md -->\n<!-- /results -->\n")
    docs_tables.main([], root=tmp_path)
    doc.write_text(doc.read_text().replace("| 1 | 24.2 |", "| 1 | 24.3 |"))
    assert docs_tables.main(["--check"], root=tmp_path) == 1
    assert "24.3" in doc.read_text()  # --check changes nothing
    docs_tables.main([], root=tmp_path)
    assert "| 1 | 24.2 |" in doc.read_text()


def test_one_section_by_its_heading(tmp_path):
    doc = _tree(tmp_path, "<!-- results: benchmarks/results/x.md ## Serving -->\n"
                          "<!-- /results -->\n")
    docs_tables.main([], root=tmp_path)
    text = doc.read_text()
    assert "24.2" not in text and text.count("Serving") == 1  # in the marker only
    assert "\n### 8 streams\n" in text and "| batchscope | 90.0 |" in text


def test_a_missing_file_or_section_is_an_error(tmp_path, capsys):
    _tree(tmp_path, "<!-- results: benchmarks/results/x.md ## Nowhere -->\n<!-- /results -->\n")
    assert docs_tables.main(["--check"], root=tmp_path) == 2
    assert "no heading '## Nowhere'" in capsys.readouterr().err
    (tmp_path / "docs" / "bench.md").write_text(
        "<!-- results: benchmarks/results/y.md -->\n<!-- /results -->\n")
    assert docs_tables.main(["--check"], root=tmp_path) == 2
    assert "no results file benchmarks/results/y.md" in capsys.readouterr().err
