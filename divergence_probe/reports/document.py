"""A report as a list of blocks, rendered three ways: Markdown, one self-contained HTML page, or LaTeX.

    blocks = [Heading("Setup", 2), Paragraph("model `qwen2`, **28** layers"),
              Table("summary", "Headline numbers", (Column("quantity"), Column("value", "num")), rows),
              Figure("layers", "Error growth", "How to read it ...")]
    md = to_markdown(blocks)                              # figures linked as figures/<stem>.png
    page = to_html(blocks, {"layers": png_bytes})         # figures embedded as base64 data URIs
    main_tex, tables = to_latex(blocks)                   # tables: {"summary": "\\begin{table}..."}

Inline markup in text is `code` and **bold**, nothing else. Table cells hold raw values and are formatted
here, once, by column kind, so every format shows the same rounding: `sig` (3 significant digits).
"""

from __future__ import annotations

import base64
import html
import math
import re
import unicodedata
from dataclasses import dataclass
from numbers import Integral, Real

import pandas as pd

SIGNIFICANT = 3
FIGURE_DIR = "figures"


# ---------------------------------------------------------------------------------------------- blocks
@dataclass(frozen=True)
class Heading:
    text: str
    level: int = 2


@dataclass(frozen=True)
class Paragraph:
    text: str


@dataclass(frozen=True)
class Bullets:
    items: tuple[str, ...]


@dataclass(frozen=True)
class Column:
    title: str
    kind: str = "auto"
    """text (inline markup), code, num (3 significant digits), int, pct (fraction shown as %), bool, prose
    (long text: a wrapped column in LaTeX), longcode (code in a wrapped column, breaking after . and _),
    auto (by the value's type; strings as code)."""


@dataclass(frozen=True)
class Table:
    name: str
    """File stem of the LaTeX table (summary -> summary.tex) and its label."""
    caption: str
    columns: tuple[Column, ...]
    rows: tuple[tuple, ...]


@dataclass(frozen=True)
class Figure:
    stem: str
    """figures/<stem>.png and figures/<stem>.pdf."""
    title: str
    caption: str


# ---------------------------------------------------------------------------------------------- numbers
def sig(x: float, digits: int = SIGNIFICANT) -> str:
    """`digits` significant digits with Python's `g` format (scientific when the exponent is < -4 or >= digits)."""
    if x == 0:
        return "0"  # also turns -0.0 into 0
    return f"{x:.{digits}g}"


def _is_missing(value) -> bool:
    """None, NaN, or pandas' missing value of a nullable column (an rl run's collapsed_at_step where none)."""
    return value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value))


def _plain(value, kind: str) -> tuple[str, str]:
    """(text, style) of one cell; style is 'code', 'num' or 'text'. Shared by every format."""
    if _is_missing(value):
        return "", "missing"
    if kind == "auto":
        if isinstance(value, bool) or type(value).__name__ == "bool_":
            kind = "bool"
        elif isinstance(value, Integral):
            kind = "int"
        elif isinstance(value, Real):
            kind = "num"
        else:
            kind = "code"
    if kind == "bool":
        return ("yes" if bool(value) else "no"), "text"
    if kind == "int":
        return str(int(value)), "num"
    if kind == "num":
        return sig(float(value)), "num"
    if kind == "pct":
        return sig(100.0 * float(value)) + "%", "num"
    if kind in ("code", "longcode"):
        return str(value), "code"
    return str(value), "text"


def _numeric(kind: str, rows, i: int) -> bool:
    if kind in ("num", "int", "pct"):
        return True
    if kind != "auto":
        return False
    values = [r[i] for r in rows if not _is_missing(r[i])]
    return bool(values) and all(isinstance(v, Real) and not isinstance(v, bool) and type(v).__name__ != "bool_"
                                for v in values)


_INLINE = re.compile(r"(`[^`]*`|\*\*[^*]+\*\*)")


def _inline(text: str, plain, code, bold) -> str:
    parts = []
    for piece in _INLINE.split(text):
        if piece.startswith("`") and piece.endswith("`") and len(piece) >= 2:
            parts.append(code(piece[1:-1]))
        elif piece.startswith("**") and piece.endswith("**") and len(piece) >= 4:
            parts.append(bold(_inline(piece[2:-2], plain, code, bold)))
        elif piece:
            parts.append(plain(piece))
    return "".join(parts)


def _numbered(blocks):
    """Yield (block, number) with tables and figures numbered separately, in document order."""
    counts = {Table: 0, Figure: 0}
    for block in blocks:
        if type(block) in counts:
            counts[type(block)] += 1
            yield block, counts[type(block)]
        else:
            yield block, None


# ---------------------------------------------------------------------------------------------- markdown
def _md_cell(value, kind: str) -> str:
    if kind in ("text", "prose") and not _is_missing(value):
        return str(value).replace("|", "\\|").replace("\n", " ")
    text, style = _plain(value, kind)
    if style == "missing":
        return "–"
    text = text.replace("|", "\\|").replace("\n", " ")
    return f"`{text}`" if style == "code" and text else text


def to_markdown(blocks) -> str:
    out: list[str] = []
    for block, number in _numbered(blocks):
        if isinstance(block, Heading):
            out.append("#" * block.level + " " + block.text)
        elif isinstance(block, Paragraph):
            out.append(block.text)
        elif isinstance(block, Bullets):
            out.append("\n".join(f"- {item}" for item in block.items))
        elif isinstance(block, Table):
            lines = [f"**Table {number}.** {block.caption}", ""]
            lines.append("| " + " | ".join(c.title.replace("|", "\\|") for c in block.columns) + " |")
            lines.append("|" + "|".join("---:" if _numeric(c.kind, block.rows, i) else ":---"
                                        for i, c in enumerate(block.columns)) + "|")
            for row in block.rows:
                lines.append("| " + " | ".join(_md_cell(v, c.kind) for v, c in zip(row, block.columns)) + " |")
            out.append("\n".join(lines))
        elif isinstance(block, Figure):
            png, pdf = f"{FIGURE_DIR}/{block.stem}.png", f"{FIGURE_DIR}/{block.stem}.pdf"
            out.append(f"![{block.title}]({png})\n\n**Figure {number}.** {block.title}. {block.caption} ([PDF]({pdf}))")
        else:
            raise TypeError(f"unknown block {block!r}")
    return "\n\n".join(out) + "\n"


# ---------------------------------------------------------------------------------------------- html
_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; max-width: 64rem; margin: 2rem auto;
       padding: 0 1rem; line-height: 1.5; color: #111; }
code { font-family: ui-monospace, "DejaVu Sans Mono", monospace; font-size: 0.92em; background: #f2f2f2;
       padding: 0 0.2em; }
table { border-collapse: collapse; margin: 0.5rem 0 1.5rem; font-size: 0.92em; }
caption { caption-side: top; text-align: left; padding-bottom: 0.3rem; }
th, td { padding: 0.2rem 0.6rem; border-bottom: 1px solid #ccc; vertical-align: top; }
thead th { border-bottom: 2px solid #111; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
figure { margin: 1.5rem 0; }
figure img { max-width: 100%; height: auto; border: 1px solid #ddd; }
""".strip()


def _html_text(text: str) -> str:
    return _inline(text, html.escape, lambda s: f"<code>{html.escape(s)}</code>", lambda s: f"<strong>{s}</strong>")


def _html_cell(value, kind: str) -> str:
    if kind in ("text", "prose") and not _is_missing(value):
        return _html_text(str(value))
    text, style = _plain(value, kind)
    if style == "missing":
        return "–"
    return f"<code>{html.escape(text)}</code>" if style == "code" and text else html.escape(text)


def to_html(blocks, images: dict[str, bytes], title: str = "divergence-probe report") -> str:
    """One page with everything inline: the PNG of every Figure block is embedded from `images[stem]`."""
    body: list[str] = []
    for block, number in _numbered(blocks):
        if isinstance(block, Heading):
            body.append(f"<h{block.level}>{_html_text(block.text)}</h{block.level}>")
        elif isinstance(block, Paragraph):
            body.append(f"<p>{_html_text(block.text)}</p>")
        elif isinstance(block, Bullets):
            body.append("<ul>\n" + "\n".join(f"<li>{_html_text(i)}</li>" for i in block.items) + "\n</ul>")
        elif isinstance(block, Table):
            numeric = [_numeric(c.kind, block.rows, i) for i, c in enumerate(block.columns)]
            cls = lambda n: ' class="num"' if n else ""  # noqa: E731
            head = "".join(f"<th{cls(n)}>{_html_text(c.title)}</th>" for c, n in zip(block.columns, numeric))
            rows = "\n".join("<tr>" + "".join(f"<td{cls(n)}>{_html_cell(v, c.kind)}</td>"
                                              for v, c, n in zip(row, block.columns, numeric)) + "</tr>"
                             for row in block.rows)
            body.append(f'<table id="table-{block.name}">\n<caption><strong>Table {number}.</strong> '
                        f"{_html_text(block.caption)}</caption>\n<thead><tr>{head}</tr></thead>\n"
                        f"<tbody>\n{rows}\n</tbody>\n</table>")
        elif isinstance(block, Figure):
            data = base64.b64encode(images[block.stem]).decode("ascii")
            body.append(f'<figure id="figure-{block.stem}">\n<img alt="{html.escape(block.title)}" '
                        f'src="data:image/png;base64,{data}">\n<figcaption><strong>Figure {number}.</strong> '
                        f"{_html_text(block.title)}. {_html_text(block.caption)}</figcaption>\n</figure>")
        else:
            raise TypeError(f"unknown block {block!r}")
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<title>{html.escape(title)}</title>\n<style>\n{_CSS}\n</style>\n</head>\n<body>\n"
            + "\n".join(body) + "\n</body>\n</html>\n")


# ---------------------------------------------------------------------------------------------- latex
_TEX_SPECIAL = {
    "\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_", "{": r"\{",
    "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "<": r"\textless{}",
    ">": r"\textgreater{}", "|": r"\textbar{}",
}
# pdflatex's default input encoding knows accented Latin letters but not these; plain LaTeX replacements.
_TEX_UNICODE = {
    "Δ": r"$\Delta$", "‖": r"$\|$", "π": r"$\pi$", "ρ": r"$\rho$", "ε": r"$\varepsilon$", "×": r"$\times$",
    "−": r"$-$", "≤": r"$\le$", "≥": r"$\ge$", "≈": r"$\approx$", "→": r"$\to$", "∖": r"$\setminus$",
    "…": r"\dots{}", "—": "---", "–": "--", "“": "``", "”": "''", "‘": "`", "’": "'", "✓": "yes",
    "·": r"$\cdot$", "±": r"$\pm$", "²": r"$^2$", "√": r"$\surd$", "≠": r"$\neq$", "∞": r"$\infty$",
    "Σ": r"$\Sigma$", "σ": r"$\sigma$", "μ": r"$\mu$", "α": r"$\alpha$", "β": r"$\beta$", "γ": r"$\gamma$",
    "λ": r"$\lambda$", "θ": r"$\theta$", "τ": r"$\tau$", "∈": r"$\in$", "≪": r"$\ll$", "≫": r"$\gg$",
    "\u00a0": "~",
}


def _tex_char(ch: str) -> str:
    if ch in _TEX_SPECIAL:
        return _TEX_SPECIAL[ch]
    if ch in _TEX_UNICODE:
        return _TEX_UNICODE[ch]
    if ch.isascii():
        return ch
    # Anything else (a model path in another script, a rare symbol): its ASCII base letter, or "?", so the
    # output always compiles with plain pdflatex.
    return unicodedata.normalize("NFKD", ch).encode("ascii", "ignore").decode("ascii") or "?"


def tex_escape(text: str) -> str:
    # Adjacent replacements ($\Sigma$$\rho$) become one formula ($\Sigma\rho$); an escaped \$ is left alone.
    return re.sub(r"(?<!\\)\$\$", "", "".join(_tex_char(ch) for ch in text))


def tex_number(text: str) -> str:
    """A number formatted by `sig` in math mode: 1.93e-05 -> $1.93\\times 10^{-5}$, -0.0156 -> $-0.0156$."""
    percent = text.endswith("%")
    core = text[:-1] if percent else text
    if core in ("inf", "-inf", "nan"):
        body = {"inf": r"\infty", "-inf": r"-\infty", "nan": r"\mathrm{NaN}"}[core]
    elif "e" in core:
        mantissa, exponent = core.split("e")
        body = (r"10^{%d}" % int(exponent)) if mantissa == "1" else (r"%s\times 10^{%d}" % (mantissa, int(exponent)))
    else:
        body = core
    return f"${body}$" + (r"\%" if percent else "")


def _tex_text(text: str) -> str:
    return _inline(text, tex_escape, lambda s: r"\texttt{" + tex_escape(s) + "}", lambda s: r"\textbf{" + s + "}")


def _tex_cell(value, kind: str) -> str:
    if kind in ("text", "prose") and not _is_missing(value):
        return _tex_text(str(value))
    text, style = _plain(value, kind)
    if style == "missing":
        return "--"
    if style == "num":
        return tex_number(text)
    if kind == "longcode" and text:  # let long identifiers break after dots and underscores
        return r"\texttt{" + tex_escape(text).replace(".", r".\allowbreak{}").replace(r"\_", r"\_\allowbreak{}") + "}"
    return r"\texttt{" + tex_escape(text) + "}" if style == "code" and text else tex_escape(text)


def latex_table(table: Table) -> str:
    """A booktabs `table` float; needs only \\usepackage{booktabs}. Wide tables are set in a smaller font."""
    numeric = [_numeric(c.kind, table.rows, i) for i, c in enumerate(table.columns)]
    wrapped = {"prose": "p{0.45\\linewidth}", "longcode": "p{%.2f\\linewidth}" % (0.8 / max(
        1, sum(c.kind == "longcode" for c in table.columns)))}
    spec = "".join(wrapped.get(c.kind) or ("r" if n else "l") for c, n in zip(table.columns, numeric))
    wide = len(table.columns) > 7
    lines = [
        r"\begin{table}[htbp]",
        r"\centering",
        r"\footnotesize" if wide else r"\small",
        r"\setlength{\tabcolsep}{3pt}" if wide else "",
        r"\caption{" + _tex_text(table.caption) + "}",
        r"\label{tab:" + table.name + "}",
        r"\begin{tabular}{" + spec + "}",
        r"\toprule",
        " & ".join(_tex_text(c.title) for c in table.columns) + r" \\",
        r"\midrule",
        *(" & ".join(_tex_cell(v, c.kind) for v, c in zip(row, table.columns)) + r" \\" for row in table.rows),
        r"\bottomrule",
        r"\end{tabular}",
        r"\end{table}",
    ]
    return "\n".join(line for line in lines if line) + "\n"


_TEX_SECTIONS = {1: "section*", 2: "section", 3: "subsection", 4: "subsubsection"}


def to_latex(blocks, title: str = "divergence-probe report") -> tuple[str, dict[str, str]]:
    """(main document, {table name: table source}). The main document \\input's each table file and includes
    the PDF figures, so `pdflatex report.tex` in the output folder builds it (packages: booktabs, graphicx)."""
    tables: dict[str, str] = {}
    body: list[str] = []
    for block, _ in _numbered(blocks):
        if isinstance(block, Heading):
            if block.level == 1:
                continue  # the document title
            body.append("\\" + _TEX_SECTIONS.get(block.level, "paragraph") + "{" + _tex_text(block.text) + "}")
        elif isinstance(block, Paragraph):
            body.append(_tex_text(block.text))
        elif isinstance(block, Bullets):
            body.append("\\begin{itemize}\n" + "\n".join(r"\item " + _tex_text(i) for i in block.items)
                        + "\n\\end{itemize}")
        elif isinstance(block, Table):
            tables[block.name] = latex_table(block)
            body.append(r"\input{" + block.name + ".tex}")
        elif isinstance(block, Figure):
            body.append("\n".join([
                r"\begin{figure}[htbp]", r"\centering",
                r"\includegraphics[width=\linewidth]{" + f"{FIGURE_DIR}/{block.stem}.pdf" + "}",
                r"\caption{" + _tex_text(f"{block.title}. {block.caption}") + "}",
                r"\label{fig:" + block.stem + "}", r"\end{figure}"]))
        else:
            raise TypeError(f"unknown block {block!r}")
    main = "\n".join([
        r"\documentclass[11pt]{article}",
        r"\usepackage[T1]{fontenc}",
        r"\usepackage[utf8]{inputenc}",
        r"\usepackage[margin=2.2cm]{geometry}",
        r"\usepackage{booktabs}",
        r"\usepackage{graphicx}",
        r"\title{" + tex_escape(title) + "}",
        r"\date{}",
        r"\begin{document}",
        r"\maketitle",
        "",
        "\n\n".join(body),
        "",
        r"\end{document}",
    ]) + "\n"
    return main, tables
