"""The documentation speaks of the tool and reaches only what a clone holds.

Three checks, none of which loads a model: no line in the user-facing text narrates how the work was organised
(who ran what, in which sitting, on which lent machine, under which tracker number); every relative link in
README.md and docs/ resolves to a file of the repository; docs/ stays a library a clone can afford.
"""
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("README.md", "docs", "divergence_probe", "benchmarks", "scripts")
TEXT_SUFFIXES = {".md", ".py", ".sh", ".txt", ".toml", ".cfg", ".html", ".tex"}
# Words that say how the work was organised rather than what the tool does. Each is anchored to the phrasing that
# narrates, so the same word in its technical sense passes: "pytest session fixture", "round to BF16",
# "helper function", "issue a warning", a "#" in a colour or a shell comment.
NARRATION = re.compile(
    r"\bsessions?\b(?![\w-]|\s+(?:fixture|scope))"  # a pytest session fixture is the tool's own vocabulary
    r"|\bsittings?\b"
    r"|\bround\s+(?:one|two|three|four|five|six)\b"
    r"|\bhelpers?\s+(?:of|ran|run|measured|found|wrote|session|report)\b"
    r"|\b(?:a|the|another|our|my)\s+helper\b(?!\s+(?:function|module|class|method|script|that|which|for|to|in|of))"
    r"|\blent\b"
    r"|\b(?:device|GPU)\s+time\s+(?:left|was\s+left|ran\s+out|allowed|went)\b|\(device\s+time\)|;\s*device\s+time\b"
    r"|(?-i:\bnvidia-h200(?:-x\d)?\b)"  # a machine kind of the lending tool, not the device's name
    r"|\bissues?\s+#?\d+|\bissue's\b"
    r"|\b(?:PR|pull\s+request)\s+#?\d+"
    r"|\btracker\b"
    r"|(?<![\w&/#])#\d{1,4}\b(?![\w;-])",  # not a CSS colour (#111;)
    re.IGNORECASE,
)


def scanned_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", *SCANNED], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / name for name in listed if Path(name).suffix in TEXT_SUFFIXES and (ROOT / name).is_file()]


def narrating_lines(path: Path) -> list[str]:
    hits = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        if NARRATION.search(line):
            hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}")
    return hits


def prose_files() -> list[Path]:
    """The scanned files less the package's data (the built-in tokenizer's training corpus is text, not prose)."""
    return [path for path in scanned_files() if "data" not in path.relative_to(ROOT).parts]


def test_no_line_narrates_how_the_work_was_organised():
    hits = [hit for path in prose_files() for hit in narrating_lines(path)]
    assert not hits, "lines that narrate the work instead of describing the tool:\n" + "\n".join(hits)


TRACKER_NUMBER = re.compile(r"\bissues?\s+#?\d+|\b(?:PR|pull\s+request)\s+#?\d+", re.IGNORECASE)


def test_no_test_cites_a_tracker_number():
    """Tests say "session" in pytest's sense, so only the tracker numbers are looked for there: a reader has no tracker."""
    tests = ROOT / "tests"
    hits = [f"{path.relative_to(ROOT)}:{number}"
            for path in sorted(tests.rglob("*.py")) if path.name != Path(__file__).name
            for number, line in enumerate(path.read_text().splitlines(), start=1) if TRACKER_NUMBER.search(line)]
    assert not hits, "tests that cite a tracker number:\n" + "\n".join(hits)


@pytest.mark.parametrize("line", [
    "Measured in the seventeenth session on the H200.",
    "The next session should rerun the floors.",
    "Round two added the compiled engine.",
    "The helper ran it on a lent H200.",
    "Not run (device time).",
    "Fixed in issue 33; see #30.",
    "Tracked as issue #29.",
    "Run A ran on nvidia-h200-x2 at d11ab12.",
    "A helper of the fifth session measured it.",
])
def test_a_narrating_line_is_caught(line, tmp_path):
    planted = tmp_path / "page.md"
    planted.write_text(f"# Page\n\nA line about the tool.\n{line}\n")
    assert len(narrating_lines_outside(planted)) == 1


@pytest.mark.parametrize("line", [
    "The session fixtures of tests/conftest.py build each checkpoint once (a pytest session fixture).",
    "Each op rounds to BF16 once; round to nearest even; a round trip through FP32.",
    "A helper function reads the manifest; issue a warning when a prompt is cut.",
    "Colours #1f77b4 and `#!/usr/bin/env bash`; the first token (id 0).",
    "The engine is available to every rank; the NVIDIA H200 has 141 GB.",
])
def test_the_same_words_in_their_technical_sense_pass(line, tmp_path):
    planted = tmp_path / "page.md"
    planted.write_text(line + "\n")
    assert narrating_lines_outside(planted) == []


def narrating_lines_outside(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if NARRATION.search(line)]


# ------------------------------------------------------------------------------------------------------ links
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|!\[[^\]]*\]\(([^)\s]+)\)")


def markdown_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation but '-' and '_' dropped, spaces to '-',
    and a repeated heading suffixed -1, -2, ... (headings inside a code block are not headings)."""
    found: set[str] = set()
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    for line in text.splitlines():
        if re.match(r"#{1,6} ", line):
            slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            repeat = next(n for n in range(len(found) + 1) if (f"{slug}-{n}" if n else slug) not in found)
            found.add(f"{slug}-{repeat}" if repeat else slug)
    return found


def broken_links(page: Path) -> list[str]:
    """Links whose file is not in the repository, or whose #anchor names no heading of the Markdown page it
    points to (the reference is many pages that link each other by anchor)."""
    broken = []
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)  # a link inside a code block is an example
    for match in LINK.finditer(text):
        target, _, anchor = (match.group(1) or match.group(2)).partition("#")
        if re.match(r"[a-z]+:", target):  # an http(s)/mailto URL
            continue
        resolved = (page.parent / target).resolve() if target else page
        if not resolved.exists() or ROOT not in (resolved, *resolved.parents):
            broken.append(f"{page.relative_to(ROOT)}: {match.group(0)}")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{page.relative_to(ROOT)}: {match.group(0)} (no such heading)")
    return broken


def test_every_relative_link_in_readme_and_docs_resolves_inside_the_repository():
    broken = [hit for page in markdown_pages() for hit in broken_links(page)]
    assert not broken, "links that do not resolve to a file of the repository:\n" + "\n".join(broken)


def test_a_broken_link_is_caught(tmp_path):
    (tmp_path / "there.md").write_text("# There\n## A\n## A\n```\n## In code\n```\n")
    page = tmp_path / "page.md"
    page.write_text("# Page\n[ok](there.md#a) [again](there.md#a-1) [here](#page) [gone](missing.md) "
                    "[web](https://example.com#x)\n[no heading](there.md#b) [not here](#a) [code](there.md#in-code)\n"
                    "```\n[code](nowhere.md)\n```\n")
    global ROOT
    root, ROOT = ROOT, tmp_path
    try:
        assert broken_links(page) == ["page.md: [gone](missing.md)",
                                      "page.md: [no heading](there.md#b) (no such heading)",
                                      "page.md: [not here](#a) (no such heading)",
                                      "page.md: [code](there.md#in-code) (no such heading)"]
    finally:
        ROOT = root


def test_no_path_outside_the_repository_is_cited():
    """A clone has no sibling folders: `../shared/...` and the like cannot be followed from it."""
    outside = re.compile(r"\.\./shared/|/work/shared")
    hits = [f"{path.relative_to(ROOT)}:{n}" for path in scanned_files()
            for n, line in enumerate(path.read_text(errors="replace").splitlines(), start=1) if outside.search(line)]
    assert not hits, "references to a path outside the repository:\n" + "\n".join(hits)


# ------------------------------------------------------------------------------------------------------- size
def test_docs_stay_a_library_a_clone_can_afford():
    """Whole run folders and logs are re-made by the command on each results page; docs/ holds pages and the
    summary-level CSVs they rest on."""
    listed = subprocess.run(["git", "ls-files", "docs"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.split()
    size = sum((ROOT / name).stat().st_size for name in listed if (ROOT / name).is_file())
    assert size <= 8 * 2**20, f"docs/ holds {size / 2**20:.1f} MiB"
    assert not [n for n in listed if n.endswith((".log", ".jsonl", ".py", ".sh"))], "docs/ holds logs or scripts"


# ------------------------------------------------------------------------------------------- guide and reference
README_BYTES = 15_000  # a guide read top to bottom: which command answers which question, details one link away
PAGE_BYTES = 32 * 1024  # the largest hand-written reference page, with room to grow
# the flag tables, generated from the CLI (tests/cli/test_cli_help.py): a table per command, each repeating the run
# spec's load and prompt options, so the page grows with every command rather than with prose to split by topic
GENERATED = {"flags.md": 48 * 1024}


def test_the_readme_is_a_guide_and_the_reference_is_pages():
    """The README names the commands and what to read in their output; every detail lives in the reference, one
    page per topic, each listed on its index, so a reader finds a page rather than scrolls a book."""
    size = (ROOT / "README.md").stat().st_size
    assert size <= README_BYTES, f"README.md is {size} bytes; move details to a page of docs/reference/"
    reference = ROOT / "docs" / "reference"
    assert not (ROOT / "docs" / "reference.md").exists(), "the reference is docs/reference/, one page per topic"
    index = (reference / "README.md").read_text()
    pages = sorted(path for path in reference.glob("*.md") if path.name != "README.md")
    assert [path.name for path in pages if f"]({path.name}" not in index] == [], "pages the index does not list"
    large = [f"{path.name}: {path.stat().st_size} bytes" for path in pages
             if path.stat().st_size > GENERATED.get(path.name, PAGE_BYTES)]
    assert not large, "reference pages to split by topic:\n" + "\n".join(large)


REPO_PATH = re.compile(
    r"(?<![\w./:-])((?:docs|benchmarks|scripts|tests|divergence_probe|sample_prompts)/[\w./-]*[\w/])")


def cited_paths(path: Path) -> list[tuple[int, str]]:
    """Repository paths a file cites in prose (`docs/results/...`, `benchmarks/x.py`), placeholders and paths in a
    git object name (`COMMIT:path`: a file of an earlier commit) left out."""
    return [(n, match) for n, line in enumerate(path.read_text(errors="replace").splitlines(), start=1)
            for match in REPO_PATH.findall(line) if not re.search(r"[<>{}*]|\.\.\.|[/_-]$|/\.", match)]


def test_every_repository_path_the_text_cites_exists():
    """A page or docstring that names `docs/results/x/y.csv` or `benchmarks/z.py` names a file a clone has."""
    missing = [f"{path.relative_to(ROOT)}:{n}: {cited}" for path in prose_files() for n, cited in cited_paths(path)
               if not (ROOT / cited).exists()]
    assert not missing, "paths cited that are not in the repository:\n" + "\n".join(missing)
