"""Copy the benchmarks' results tables into the docs, so no measured figure is retyped.

Each benchmark writes its tables to benchmarks/results/NAME.md. A doc (README.md, docs/*.md)
includes one between two marker comments, the whole file or one section of it named by its
heading line:

    <!-- results: benchmarks/results/engine_batching.md -->
    ...copied by this script...
    <!-- /results -->

    <!-- results: benchmarks/results/llama_cpp.md ## Decode, aggregate tok/s -->

The copy leaves out the file's title (or the named section's heading), moves the remaining
headings so the shallowest is a `###`, and rewrites relative links for the doc's folder.

    .venv/bin/python scripts/docs_tables.py          # rewrite the copies in place
    .venv/bin/python scripts/docs_tables.py --check  # exit 1 naming each stale copy
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_BLOCK = re.compile(
    r"(?P<open><!-- results: (?P<src>\S+)(?: (?P<section>#+ [^\n]*?))? -->\n)"
    r"(?P<body>.*?)"
    r"(?P<close><!-- /results -->)",
    re.DOTALL,
)
_HEADING = re.compile(r"^(#+) ")
_LINK = re.compile(r"\]\((?![a-z]+:|#|/)([^)\s]+)\)")


def docs(root: Path) -> list[Path]:
    """The documents that may include results: the README and docs/*.md."""
    return [p for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))] if p.is_file()]


def _level(line: str) -> int:
    m = _HEADING.match(line)
    return len(m.group(1)) if m else 0


def _section(lines: list[str], heading: str | None, src: Path) -> list[str]:
    """The lines under `heading` (to the next heading as deep or shallower), or the whole file
    without its `# ` title."""
    if heading is None:
        return lines[1:] if lines and _level(lines[0]) == 1 else lines
    for i, line in enumerate(lines):
        if line.rstrip() == heading:
            end = next((j for j in range(i + 1, len(lines))
                        if 0 < _level(lines[j]) <= _level(heading)), len(lines))
            return lines[i + 1:end]
    raise ValueError(f"{src}: no heading {heading!r}")


def render(root: Path, doc: Path, src: str, heading: str | None) -> str:
    """What the doc's block for `src` (and `heading`) holds, markers excluded."""
    path = root / src
    if not path.is_file():
        raise ValueError(f"{doc.relative_to(root)}: no results file {src}")
    lines = _section(path.read_text().splitlines(), heading, path.relative_to(root))
    # Headings nest under the doc's own `##` section whatever depth the results file used.
    depths = [_level(line) for line in lines if _level(line)]
    shift = 3 - min(depths) if depths else 0
    rel = os.path.relpath(path.parent, doc.parent)
    out = []
    for line in lines:
        if (n := _level(line)):
            line = "#" * (n + shift) + line[n:]
        out.append(_LINK.sub(lambda m: f"]({Path(rel, m.group(1)).as_posix()})", line))
    return "\n" + "\n".join(out).strip("\n") + "\n\n"


def refresh(root: Path, doc: Path) -> tuple[str, list[str]]:
    """The doc's text with every results block copied afresh, and the blocks that changed."""
    changed: list[str] = []

    def fill(m: re.Match[str]) -> str:
        src = m.group("src") + (f" {m.group('section')}" if m.group("section") else "")
        body = render(root, doc, m.group("src"), m.group("section"))
        if body != m.group("body"):
            changed.append(src)
        return m.group("open") + body + m.group("close")

    return _BLOCK.sub(fill, doc.read_text()), changed


def main(argv: list[str] | None = None, root: Path = ROOT) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="change nothing; exit 1 if a doc's copy differs from its results file")
    args = ap.parse_args(argv)
    stale = 0
    for doc in docs(root):
        try:
            text, changed = refresh(root, doc)
        except ValueError as e:
            print(f"docs_tables: {e}", file=sys.stderr)
            return 2
        for src in changed:
            verb = "differs from" if args.check else "copied again from"
            print(f"{doc.relative_to(root)}: {verb} {src}", file=sys.stderr)
        stale += len(changed)
        if changed and not args.check:
            doc.write_text(text)
    if args.check and stale:
        print("run: .venv/bin/python scripts/docs_tables.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
