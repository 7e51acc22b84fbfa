"""Memory and time inside the documented limits: a rollout file past a bound is refused in one line under an
address-space cap, a file at a bound is scored within the memory docs/reference/errors.md states for it, running out of
memory below the bounds is named as such (not as a broken file), and counts whose cost grows without bound are
refused before anything loads.

The adversarial files are made here, small on disk (runs of zeros, gzip members repeated, Parquet's run-length
encoding); the caps are the measured address space of the import alone plus what the bound is documented to cost.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import resource
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from divergence_probe.cli import app
from divergence_probe.rollouts import read, read_rollouts
from divergence_probe.runs.paired import paired_run
from divergence_probe.spec.align import MAX_BOOTSTRAP, MAX_COMBINATIONS
from test_compare_cli import assert_nothing_written, assert_one_line_error

REPO = Path(__file__).resolve().parents[2]
MiB = 2**20
# What docs/reference/errors.md states a model-free score holds per value it reads (a token id, a logprob), with room for
# the allocator; and what the command takes over its imports whatever it reads (its tables, pandas' and arrow's pools).
PER_VALUE = 150
OVERHEAD = 512 * MiB
IMPORTS = "import divergence_probe.cli, divergence_probe.runs.score, divergence_probe.runs.paired, pyarrow.parquet"


@pytest.fixture(scope="module")
def imports_peak() -> int:
    """The address space score's imports take alone (torch, pandas, pyarrow), measured in a process of its own."""
    code = f"{IMPORTS}\nprint(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmPeak')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    return int(out.stdout.split()[-1]) * 1024


# `score FILE --out OUT` for each pair of arguments, in one child process (one start-up, one cap for all): its exit
# code and output per file, as a JSON list.
SCORE_EACH = """
import json, sys
from typer.testing import CliRunner
from divergence_probe.cli import app
results = []
for path, out in zip(sys.argv[1::2], sys.argv[2::2]):
    result = CliRunner().invoke(app, ["score", path, "--out", out])
    results.append([result.exit_code, result.output])
print(json.dumps(results))
"""


def _score_capped(cap: int, *files: tuple[Path, Path]) -> list[tuple[int, str]]:
    """(exit code, output) of `divergence-probe score PATH --out OUT` for each (PATH, OUT), in a process whose address
    space is capped at `cap` bytes."""
    proc = subprocess.run([sys.executable, "-c", SCORE_EACH, *(str(p) for pair in files for p in pair)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)},
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (cap, cap)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [tuple(r) for r in json.loads(proc.stdout.splitlines()[-1])]


def _row(tokens: int) -> bytes:
    """One generic row with both logprob columns (model-free) and `tokens` response tokens: 3 * tokens + 4 values
    (the fields, the prompt id and one id and two logprobs per token), a few bytes each."""
    zeros = ", ".join(["0"] * tokens)
    ids = ", ".join(["5"] * tokens)
    return (f'{{"prompt_ids": [1], "response_ids": [{ids}], "logprobs": [{zeros}], '
            f'"train_logprobs": [{zeros}]}}\n').encode()


def _one_line(result: tuple[int, str], *needles: str) -> str:
    code, output = result
    lines = output.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, lines[-5:])
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.mark.engine  # the command in a child process of its own, capped
def test_rollout_files_past_a_bound_are_one_line_under_a_memory_cap(imports_peak, tmp_path):
    """A row past the values of one row (plain or gzipped), a gzip of rows each inside that bound but past the
    file's, and a Parquet file of a few kB declaring more values than a file may hold: each refused in one line,
    exit 2, nothing in --out, by a command whose address space is what its imports take and 1 GiB more."""
    over_row = _row(read.MAX_ROW_VALUES // 3 + 1)
    (tmp_path / "row.jsonl").write_bytes(over_row)
    (tmp_path / "row.jsonl.gz").write_bytes(gzip.compress(over_row))
    member = gzip.compress(_row(read.MAX_ROW_VALUES // 3 - 2))  # inside the row bound; the file passes its own
    (tmp_path / "rows.jsonl.gz").write_bytes(member * (read.MAX_VALUES // read.MAX_ROW_VALUES + 1))
    zeros = pa.array(np.zeros(read.MAX_VALUES + 1, np.float64))
    column = pa.ListArray.from_arrays(pa.array([0, len(zeros)], pa.int32()), zeros)
    pq.write_table(pa.table({"prompt_ids": [[1]], "response_ids": [[5]], "logprobs": [[-1.0]],
                             "train_logprobs": column}), tmp_path / "values.parquet")
    assert (tmp_path / "values.parquet").stat().st_size < 64 * 1024
    cases = {"row.jsonl": f"over the {read.MAX_ROW_VALUES} values of one rollout row",
             "row.jsonl.gz": f"over the {read.MAX_ROW_VALUES} values of one rollout row",
             "rows.jsonl.gz": f"holds over {read.MAX_VALUES} values",
             "values.parquet": f"over the {read.MAX_VALUES} values"}
    outs = {name: tmp_path / f"out-{name}" for name in cases}
    results = _score_capped(imports_peak + 2**30, *((tmp_path / name, outs[name]) for name in cases))
    for result, (name, says) in zip(results, cases.items()):
        _one_line(result, name, says)
        assert_nothing_written(outs[name])


@pytest.mark.engine  # the command in a child process of its own, capped
def test_a_row_at_its_bound_is_scored_within_the_stated_memory(imports_peak, tmp_path):
    """The largest row a file may hold, scored model-free by a command capped at its imports, the fixed overhead
    and the stated memory per value: the memory grows with the values, not 68 times the bytes."""
    tokens = (read.MAX_ROW_VALUES - 4) // 3
    path = tmp_path / "row.jsonl"
    path.write_bytes(_row(tokens))
    [(code, output)] = _score_capped(imports_peak + OVERHEAD + PER_VALUE * read.MAX_ROW_VALUES, (path, tmp_path / "out"))
    assert code == 0, output[-3000:]
    with open(tmp_path / "out" / "tokens.csv") as f:
        assert sum(1 for _ in f) == tokens + 1


@pytest.mark.engine  # the command in a child process of its own, capped
def test_running_out_of_memory_inside_the_bounds_is_named_as_memory(imports_peak, tmp_path):
    """A Parquet file inside every bound, read by a process capped below what its values take as Python objects:
    one line that says memory ran out and what to do, not that the file is not Parquet."""
    tokens = (read.MAX_ROW_VALUES - 4) // 3
    rows = read.MAX_VALUES // read.MAX_ROW_VALUES - 1
    lps = pa.array(np.full(tokens * rows, -0.5))
    offsets = pa.array(np.arange(rows + 1, dtype=np.int32) * tokens)
    table = pa.table({"prompt_ids": [[1]] * rows, "response_ids": pa.ListArray.from_arrays(
                          offsets, pa.array(np.full(tokens * rows, 5, np.int64))),
                      "logprobs": pa.ListArray.from_arrays(offsets, lps),
                      "train_logprobs": pa.ListArray.from_arrays(offsets, lps)})
    pq.write_table(table, tmp_path / "r.parquet")
    out = tmp_path / "out"
    [result] = _score_capped(imports_peak + 256 * MiB, (tmp_path / "r.parquet", out))
    line = _one_line(result, "out of memory reading", "raise its memory limit or split the file")
    assert "not a Parquet file" not in line
    assert_nothing_written(out)


def test_a_model_free_score_holds_a_bounded_amount_per_value(tmp_path):
    """Reading a file and making score's tables hold at most PER_VALUE bytes per value read at their peak (Python's
    and numpy's allocations): no object or dict per token, no table built twice."""
    rng = random.Random(0)
    tokens = 30_000
    row = {"prompt_ids": list(range(1, 65)), "response_ids": [rng.randrange(300, 50_000) for _ in range(tokens)],
           "logprobs": [-rng.random() for _ in range(tokens)], "train_logprobs": [-rng.random() for _ in range(tokens)]}
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(row) + "\n")
    values = 3 * tokens + 64 + len(row)
    read_rollouts(path)  # imports and caches outside the measure
    tracemalloc.start()
    try:
        files = paired_run(read_rollouts(path), 0.2, 2.0).files()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(files["tokens.csv"]) == tokens
    assert peak <= PER_VALUE * values, f"{peak / values:.0f} bytes per value"


def test_running_out_of_memory_while_scoring_is_one_line(tmp_path, monkeypatch):
    """Memory that runs out after the file is read (the tables of a file near its bounds, under a tight limit): one
    line naming the file and what to do, exit 2, nothing in --out."""
    import divergence_probe.runs.paired as paired

    def exhausted(*_):
        raise MemoryError

    monkeypatch.setattr(paired, "paired_run", exhausted)
    path = tmp_path / "r.jsonl"
    path.write_bytes(_row(3))
    result = CliRunner().invoke(app, ["score", str(path), "--out", str(tmp_path / "out")])
    assert_one_line_error(result, f"out of memory scoring {path}", "raise its memory limit or split the file")
    assert_nothing_written(tmp_path / "out")


@pytest.mark.parametrize("args, says", [
    (["ablate", "--bootstrap", "1000000000"], f"outside 0 to {MAX_BOOTSTRAP:,}"),
    (["ablate", "--bootstrap", str(MAX_BOOTSTRAP + 1)], f"outside 0 to {MAX_BOOTSTRAP:,}"),
    (["ablate", "--regions", "rope,swiglu,rmsnorm,routing,lm_head,residual", "--factor", "train:precision=amp"],
     f"over the {MAX_COMBINATIONS} it runs at most, each a full compare; ablate fewer with --regions and --factor"),
    (["compare", "--mode", "generate", "--samples-per-prompt", "1000000000"], "--samples-per-prompt must be from 1"),
    (["compare", "--mode", "generate", "--max-new-tokens", "1000000000"], "--max-new-tokens must be from 1"),
])
def test_counts_past_their_bound_are_refused_before_loading(args, says, tmp_path, monkeypatch):
    """A count whose time or memory grows with it, past its bound: one line naming the bound, before any model
    resolves."""
    import divergence_probe.models.source as source

    monkeypatch.setattr(source, "resolve_model", lambda *a, **k: pytest.fail("a model was resolved"))
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "out")])
    assert_one_line_error(result, says)
    assert_nothing_written(tmp_path / "out")
