"""A report's files, whichever run kind it reports: the main file of each format, and the document written as them.
Shared by the run folders' reports (render.py) and the rl report (rl.py), below both."""

from __future__ import annotations

from pathlib import Path

from . import document as doc

FORMATS = {"md": "report.md", "html": "report.html", "latex": "report.tex"}
REPORT = "report"  # the kind of output a report folder is marked as (rl reports too)


def write_document(out: Path, blocks, fmt: str, heading: str, images: dict[str, bytes] | None = None) -> None:
    """`blocks` as out/report.md, one report.html (every Figure block's PNG inlined: `images`, stem -> PNG bytes, or
    read from out/figures when not given) or report.tex and a .tex per table. Shared by every run kind's report (the
    rl report too)."""
    if fmt == "md":
        (out / FORMATS["md"]).write_text(doc.to_markdown(blocks), encoding="utf-8")
    elif fmt == "html":
        if images is None:
            images = {b.stem: (out / doc.FIGURE_DIR / f"{b.stem}.png").read_bytes() for b in blocks
                      if isinstance(b, doc.Figure)}
        (out / FORMATS["html"]).write_text(doc.to_html(blocks, images, heading), encoding="utf-8")
    else:
        main, tables = doc.to_latex(blocks, heading)
        for name, source in tables.items():
            (out / f"{name}.tex").write_text(source, encoding="utf-8")
        (out / FORMATS["latex"]).write_text(main, encoding="utf-8")
