"""Each benchmark owns one marked section of docs/benchmarks.md and rewrites only that section."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS_MD = ROOT / "docs" / "benchmarks.md"


def add_out_argument(parser: argparse.ArgumentParser) -> None:
    """--out: a smoke run's or another machine's numbers go to a file of their own, so docs/ keeps the cited run."""
    parser.add_argument("--out", type=Path, default=None,
                        help="write the raw numbers (JSON) here and leave docs/ as it is")


def write_section(name: str, markdown: str, raw: dict, out: Path | None = None) -> None:
    """Replace the `<!-- name:start -->`..`<!-- name:end -->` block (appending it the first time) and save the
    raw numbers as docs/benchmarks/<name>.json; with `out`, only the raw numbers, there."""
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
        return
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{markdown.rstrip()}\n{end}"
    text = DOCS_MD.read_text() if DOCS_MD.exists() else "# Benchmarks\n"
    if start in text and end in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    DOCS_MD.write_text(text)
    (ROOT / "docs" / "benchmarks" / f"{name}.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
