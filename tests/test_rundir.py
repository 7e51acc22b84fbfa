"""rundir: --out checks, the lock on --out, atomic run folders with rows and sha256 in the manifest, the rescue
of results on a full disk, and read_run refusing cut or changed files (so `report` never renders them).

No model: the tables are small frames with the documented columns.
"""

from __future__ import annotations

import errno
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from divergence_probe import rundir
from divergence_probe.cli import app
from divergence_probe.errors import OutputError, ProbeError, one_line
from divergence_probe.prompts import Prompt
from divergence_probe.reports import ReportError, write_report
from divergence_probe.reports import figures
from divergence_probe.run_folder import read_run
from divergence_probe.rundir import (RunFolderError, check_out_dir, claim_out_dir, default_out_dir, locked, write_csv,
                                     write_run)

runner = CliRunner()
REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------- fixtures
def _prompts(n: int = 3) -> list[Prompt]:
    return [Prompt(i, f"p.txt:{i}", f"text {i}\nwith a line break", (1, 2, 3 + i), i == 1) for i in range(n)]


def _tables(seed: int = 0) -> dict[str, pd.DataFrame]:
    rng = np.random.default_rng(seed)
    n = 60
    delta = rng.normal(0, 0.01, n)
    tokens = pd.DataFrame({"prompt_id": np.repeat(np.arange(3), n // 3),
                           "position": np.tile(np.arange(1, n // 3 + 1), 3), "token_id": rng.integers(0, 500, n),
                           "token": ["a,\"b\"\nc" if i == 5 else f"t{i}" for i in range(n)],
                           "logprob_infer": -rng.exponential(3, n), "delta_logprob": delta, "kl": np.abs(delta) ** 2})
    tokens["logprob_train"] = tokens["logprob_infer"] + delta
    layers = pd.DataFrame({"layer": np.repeat(np.arange(4), 2), "tap": ["q_rope", "resid_out"] * 4,
                           "rel_l2": rng.uniform(0, 1e-2, 8), "max_ulp": rng.integers(0, 9, 8)})
    summary = pd.DataFrame([{"mean_abs_dlogp": float(np.abs(delta).mean()), "mean_kl": float(tokens["kl"].mean()),
                             "first_inexact": "q_rope@0", "first_over_threshold": "none", "n_tokens": n}])
    return {"tokens.csv": tokens, "layers.csv": layers, "summary.csv": summary}


def _manifest() -> dict:
    return {"kind": "compare", "compare": {"mode": "prefill", "threshold": 0.001, "taps": ["q_rope", "resid_out"]},
            "model": {"spec": "/m/tiny", "num_layers": 4, "arch": "qwen3"}, "load": {"seed": 0}}


def make_run(path: Path) -> Path:
    return write_run(path, _manifest(), _prompts(), _tables())


def lines_of(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


def leftovers(parent: Path) -> list[str]:
    """Hidden partial, old, check or lock entries: anything a write must not leave behind."""
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


# ---------------------------------------------------------------------------------------------- writing
def test_write_run_records_rows_and_sha256_and_keeps_csv_bytes(tmp_path):
    tables = _tables()
    out = make_run(tmp_path / "run")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["kind"] == "compare"
    assert set(manifest["files"]) == {"prompts.jsonl", *tables}
    for name, df in tables.items():
        data = (out / name).read_bytes()
        assert data == df.to_csv(index=False, lineterminator="\n").encode()  # the bytes compare always wrote
        assert manifest["files"][name] == {"rows": len(df), "sha256": hashlib.sha256(data).hexdigest()}
    prompts = (out / "prompts.jsonl").read_bytes()
    assert manifest["files"]["prompts.jsonl"] == {"rows": 3, "sha256": hashlib.sha256(prompts).hexdigest()}
    assert not leftovers(tmp_path)

    back = read_run(out)
    assert [p["prompt_id"] for p in back.prompts] == [0, 1, 2] and back.prompts[1]["truncated"]
    assert back.table("tokens.csv")["token"][5] == "a,\"b\"\nc"  # a line break inside a quoted field
    pd.testing.assert_frame_equal(back.table("layers.csv"), tables["layers.csv"])


def test_run_kind_is_data(tmp_path):
    with pytest.raises(ValueError, match="kind"):
        write_run(tmp_path / "a", {"compare": {}}, _prompts(), _tables())
    assert not (tmp_path / "a").exists() and not leftovers(tmp_path)

    write_run(tmp_path / "b", {"kind": "ablate"}, _prompts(), _tables())
    assert json.loads((tmp_path / "b" / "manifest.json").read_text())["kind"] == "ablate"


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_interrupted_write_leaves_nothing(interrupt, tmp_path, monkeypatch):
    real = rundir.write_csv

    def write_csv(df, path):
        if path.name == "layers.csv":
            raise interrupt()
        real(df, path)

    monkeypatch.setattr(rundir, "write_csv", write_csv)
    with pytest.raises(interrupt):
        make_run(tmp_path / "run")
    assert not (tmp_path / "run").exists() and not leftovers(tmp_path)


# ---------------------------------------------------------------------------------------------- full disk
def _full_disk(monkeypatch, fail_rescue: bool):
    """write_csv raises ENOSPC on tokens.csv of the run (and of the rescue too, if fail_rescue)."""
    real = rundir.write_csv

    def write_csv(df, path):
        rescue = "divergence-probe-rescue-" in path.parent.name
        if path.name == "tokens.csv" and (fail_rescue or not rescue):
            raise OSError(errno.ENOSPC, "No space left on device")
        real(df, path)

    monkeypatch.setattr(rundir, "write_csv", write_csv)


def test_full_disk_names_the_file_and_rescues_the_results(tmp_path, monkeypatch):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    _full_disk(monkeypatch, fail_rescue=False)
    (tmp_path / "out").mkdir()
    with pytest.raises(OutputError) as info:
        make_run(tmp_path / "out" / "run")
    message = str(info.value)
    assert "\n" not in message and "No space left on device" in message
    assert f"cannot write {tmp_path / 'out' / 'run' / 'tokens.csv'}" in message and "choose another --out" in message
    assert not (tmp_path / "out" / "run").exists() and not leftovers(tmp_path / "out")

    (rescue,) = scratch.iterdir()
    assert f"saved to {rescue} instead" in message
    monkeypatch.undo()
    back = read_run(rescue)  # complete, with its manifest's rows and hashes
    expected = _tables()
    assert set(back.tables) == set(expected) and len(back.prompts) == 3
    csv = expected["tokens.csv"].to_csv(index=False, lineterminator="\n").encode()
    assert (rescue / "tokens.csv").read_bytes() == csv


def test_full_disk_everywhere_says_so(tmp_path, monkeypatch):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    _full_disk(monkeypatch, fail_rescue=True)
    with pytest.raises(OutputError, match="could not be saved elsewhere either .No space left on device.") as info:
        make_run(tmp_path / "run")
    assert "\n" not in str(info.value)
    assert not (tmp_path / "run").exists() and not leftovers(tmp_path) and not list(scratch.iterdir())


# ---------------------------------------------------------------------------------------------- --out
def test_out_dir_messages_say_the_real_problem(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError, match=rf"cannot write --out {tmp_path}/file/run: {tmp_path}/file is a file, "
                                          "not a folder; choose another --out"):
        check_out_dir(tmp_path / "file" / "run")
    with pytest.raises(OutputError, match=rf": {tmp_path}/file is a file, not a folder"):
        check_out_dir(tmp_path / "file" / "deeper" / "run")
    with pytest.raises(OutputError, match="is a file, not a folder; choose another --out or remove the file"):
        check_out_dir(tmp_path / "file")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    with pytest.raises(OutputError, match="already exists and is not empty; choose another --out or remove it"):
        check_out_dir(tmp_path / "busy")
    check_out_dir(tmp_path / "new" / "run")  # new parents are fine
    assert not leftovers(tmp_path)


def test_default_out_dirs_do_not_collide(tmp_path, monkeypatch):
    a, b = default_out_dir(tmp_path), default_out_dir(tmp_path)
    assert a != b and a.parent == tmp_path

    class Frozen:
        @staticmethod
        def now():
            from datetime import datetime
            return datetime(2026, 1, 2, 3, 4, 5, 6)

    monkeypatch.setattr(rundir, "datetime", Frozen)
    first = default_out_dir(tmp_path)
    assert first.name == "20260102-030405-000006"
    first.mkdir()
    second = default_out_dir(tmp_path)
    assert second.name == "20260102-030405-000006-2"
    with claim_out_dir(second):  # a name claimed by a running run is taken too
        assert default_out_dir(tmp_path).name == "20260102-030405-000006-3"


HOLD = """
import sys
from divergence_probe.rundir import claim_out_dir
with claim_out_dir(sys.argv[1]):
    print("held", flush=True)
    sys.stdin.read()
"""


def test_second_writer_to_the_same_out_fails_fast(tmp_path):
    target = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(target)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == "held"
        lock = tmp_path / ".run.lock"
        with pytest.raises(OutputError, match=rf"being written by another run \(process {holder.pid}, lock {lock}\); "
                                              "wait for it to finish or choose another --out"):
            with claim_out_dir(target):
                pass
        with pytest.raises(OutputError, match="being written by another run"):
            make_run(target)
        assert not target.exists()
    finally:
        holder.communicate("", timeout=60)
    assert holder.returncode == 0 and not leftovers(tmp_path)  # the holder removed its lock
    make_run(target)


def test_lock_file_of_a_dead_run_does_not_block(tmp_path):
    (tmp_path / ".run.lock").write_text("999999\n")  # a run killed with SIGKILL leaves its file, not its lock
    make_run(tmp_path / "run")
    assert not leftovers(tmp_path)


# ---------------------------------------------------------------------------------------------- reading
def _cut_csv(path: Path) -> None:
    path.write_bytes(b"".join(lines_of(path)[:-3]))


def _cut_mid_line(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-7])


def _cut_prompts(path: Path) -> None:
    path.write_bytes(b"".join(lines_of(path)[:-1]))


def _change_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    i = data.index(b"q_rope@0")
    data[i : i + 8] = b"q_rope@1"  # same length, still a valid CSV
    path.write_bytes(bytes(data))


CUTS = [
    ("tokens.csv", _cut_csv, r"tokens.csv is cut short \(57 of the 60 rows the manifest lists\)"),
    ("layers.csv", _cut_mid_line, r"layers.csv (is cut short|does not match)"),
    ("prompts.jsonl", _cut_prompts, r"prompts.jsonl is cut short \(2 of the 3 rows the manifest lists\)"),
    ("summary.csv", _change_byte, r"summary.csv does not match the sha256 the manifest records"),
]


@pytest.mark.parametrize("name, damage, message", CUTS, ids=[c[0] for c in CUTS])
def test_cut_or_changed_file_is_refused(name, damage, message, tmp_path, monkeypatch):
    run = make_run(tmp_path / "run")
    damage(run / name)
    with pytest.raises(RunFolderError, match=message) as info:
        read_run(run)
    assert "\n" not in str(info.value) and "rerun the command that made the run folder" in str(info.value)
    with pytest.raises(ReportError, match=message):
        write_report(run)
    assert not (run / "report").exists() and not leftovers(run)

    monkeypatch.delenv("DP_RAISE_ERRORS", raising=False)
    result = runner.invoke(app, ["report", str(run)])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert name in result.output and not (run / "report").exists()


def test_listed_file_missing_is_refused_but_tokens_may_go(tmp_path):
    run = make_run(tmp_path / "run")
    (run / "layers.csv").unlink()
    with pytest.raises(RunFolderError, match="layers.csv is listed in the manifest but missing"):
        read_run(run)
    run = make_run(tmp_path / "run2")
    (run / "tokens.csv").unlink()
    assert read_run(run).table("tokens.csv") is None
    assert "no tokens.csv" in write_report(run).read_text()


def test_tokens_gzipped_afterwards_are_checked_by_content(tmp_path):
    run = make_run(tmp_path / "run")
    plain = write_report(run, tmp_path / "plain").read_text()
    data = (run / "tokens.csv").read_bytes()
    (run / "tokens.csv").unlink()
    (run / "tokens.csv.gz").write_bytes(gzip.compress(data))
    assert write_report(run, tmp_path / "gz").read_text() == plain
    (run / "tokens.csv.gz").write_bytes(gzip.compress(b"".join(data.splitlines(keepends=True)[:-2])))
    with pytest.raises(RunFolderError, match=r"tokens.csv.gz is cut short \(58 of the 60 rows"):
        read_run(run)
    (run / "tokens.csv.gz").write_bytes(gzip.compress(data)[:-20])  # the gzip stream itself cut
    with pytest.raises(RunFolderError, match="cannot read .*tokens.csv.gz"):
        read_run(run)


def _legacy(tmp_path: Path) -> Path:
    """A run folder as written before manifests listed their files."""
    run = make_run(tmp_path / "legacy")
    manifest = json.loads((run / "manifest.json").read_text())
    del manifest["files"], manifest["kind"]
    (run / "manifest.json").write_text(json.dumps(manifest))
    return run


def test_legacy_folder_without_files_renders(tmp_path):
    run = _legacy(tmp_path)
    text = write_report(run).read_text()
    assert "3 prompts (1 truncated" in text and "`q_rope@0`" in text


@pytest.mark.parametrize("name, damage, message", [
    ("tokens.csv", _cut_mid_line, "tokens.csv does not end with a line break, so it was cut short"),
    ("prompts.jsonl", _cut_mid_line, "prompts.jsonl does not end with a line break"),
    ("layers.csv", lambda p: p.write_text("layer,tap\n0,q_rope\n"), "layers.csv lacks the column.s. rel_l2"),
    ("prompts.jsonl", lambda p: p.write_text('{"prompt_id": 0}\n{"prompt_id": \n'),
     "prompts.jsonl has a line that is not JSON .line 2"),
])
def test_legacy_folder_cut_file_is_refused(name, damage, message, tmp_path):
    run = _legacy(tmp_path)
    damage(run / name)
    with pytest.raises(ReportError, match=message) as info:
        write_report(run)
    assert isinstance(info.value, ProbeError) and "\n" not in str(info.value)
    assert not (run / "report").exists()


LEGACY_RUNS = REPO / "tests" / "fixtures" / "legacy_runs"


def test_shipped_run_folders_read(tmp_path):
    """Run folders written on a GPU before manifests listed their files (cut to two prompts): they still read."""
    runs = sorted(p.parent for p in LEGACY_RUNS.rglob("manifest.json"))
    assert len(runs) == 2
    for run in runs:
        folder = read_run(run)
        assert "summary.csv" in folder.tables


def _edit_line(path: Path, line: int, old: str, new: str) -> None:
    lines = path.read_text().splitlines(keepends=True)
    assert old in lines[line - 1]
    lines[line - 1] = lines[line - 1].replace(old, new, 1)
    path.write_text("".join(lines))


def _rehash(run: Path) -> None:
    """The manifest's `files` made to match the files as they are now (an edit that keeps the hashes consistent)."""
    manifest = json.loads((run / "manifest.json").read_text())
    for name, record in manifest["files"].items():
        record["sha256"] = hashlib.sha256((run / name).read_bytes()).hexdigest()
    (run / "manifest.json").write_text(json.dumps(manifest))


# (file, line, text there, edited to, what the one line says after the file's name)
EDITS = [
    ("summary.csv", 2, "input_norm@0", "input_norm@0", None),  # untouched: the fixture reads
    ("summary.csv", 2, "0.02461902890354395", "abc",
     "summary.csv row 1 (line 2): column mean_abs_dlogp holds 'abc', not a number"),
    ("summary.csv", 2, "0.0054", "1e-3x", "summary.csv row 1 (line 2): column noise_infer_mean_abs_dlogp holds"),
    ("layers.csv", 3, "0.002819915918253825", "x", "layers.csv row 2 (line 3): column rel_l2 holds 'x', not a number"),
    ("layers.csv", 2, "-1,embed", "first,embed", "layers.csv row 1 (line 2): column layer holds 'first'"),
    ("layers.csv", 2, "-1,embed", "-1,-1,embed", "layers.csv row 1 (line 2) has 9 fields, not the 8 of its header"),
    ("layers.csv", 3, "0,input_norm", "0,0,input_norm", "layers.csv row 2 (line 3) has 9 fields, not the 8 of its"),
    ("layers.csv", 3, "0,input_norm,", "0,", "layers.csv row 2 (line 3) has 7 fields, not the 8 of its header"),
    ("prompts.jsonl", 1, '{"prompt_id": 0', '[{"prompt_id": 0', "prompts.jsonl line 1"),
    ("prompts.jsonl", 2, '{"prompt_id": 1', '{"prompt_id": [1]', "prompts.jsonl line 2: `prompt_id` is [1], not a"),
    ("prompts.jsonl", 1, '"token_ids": [', '"token_ids": [true, ', "prompts.jsonl line 1: `token_ids` holds"),
]


@pytest.mark.parametrize("name, line, old, new, says", EDITS)
@pytest.mark.parametrize("hashed", [False, True], ids=["older folder", "hashes kept consistent"])
def test_an_edited_run_folder_is_one_line_for_diff_and_report(name, line, old, new, says, hashed, tmp_path):
    """A run folder edited where a reader needs numbers or prompt records: diff and report refuse it in one line
    naming the file and the row, exit code 2, nothing written, whether the folder predates the manifest's hashes or
    its hashes were edited to match."""
    good = shutil.copytree(LEGACY_RUNS / "generate", tmp_path / "good")
    run = shutil.copytree(LEGACY_RUNS / "generate", tmp_path / "run")
    if name == "prompts.jsonl" and new.startswith("["):
        _edit_line(run / name, line, "\n", "]\n")
    _edit_line(run / name, line, old, new)
    if hashed:
        manifest = json.loads((run / "manifest.json").read_text())
        manifest["files"] = {p.name: {"sha256": ""} for p in run.iterdir() if p.name != "manifest.json"}
        (run / "manifest.json").write_text(json.dumps(manifest))
        _rehash(run)
    for args in (["diff", good, run, "--out", tmp_path / "d"], ["report", run, "--out", tmp_path / "r.md"]):
        result = CliRunner().invoke(app, [str(a) for a in args])
        if says is None:
            assert result.exit_code == 0, result.output
            continue
        assert result.exit_code == 2, result.output
        (error,) = result.output.splitlines()
        assert error.startswith(f"error: {run / name.split(' ')[0]}") and says in error, error
        assert not (tmp_path / "d").exists() and not (tmp_path / "r.md").exists()


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_a_stop_the_moment_the_hidden_folder_is_made_leaves_nothing(interrupt, tmp_path, monkeypatch):
    """A signal is raised at the first bytecode after a system call: here, right after mkdir of the hidden folder,
    before any code of the block runs (what a SIGTERM sent as soon as the folder appears meets)."""
    real_mkdir = Path.mkdir

    def mkdir_then_stop(self, *args, **kwargs):
        real_mkdir(self, *args, **kwargs)
        if self.name.startswith(".out.partial-"):
            raise interrupt()

    monkeypatch.setattr(Path, "mkdir", mkdir_then_stop)
    with pytest.raises(interrupt):
        with rundir.atomic_dir(tmp_path / "out"):
            pass
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------- report writer
@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_interrupted_render_leaves_nothing(interrupt, tmp_path, monkeypatch):
    """What SIGINT (KeyboardInterrupt) or SIGTERM turned into SystemExit does midway through a render."""
    run = make_run(tmp_path / "run")

    def interrupted(*args, **kwargs):
        raise interrupt()

    monkeypatch.setattr(figures, "delta_histogram", interrupted)  # after the layer figure was saved
    with pytest.raises(interrupt):
        write_report(run)
    assert not (run / "report").exists() and not leftovers(run)
    with pytest.raises(interrupt):
        write_report(run, tmp_path / "elsewhere", fmt="html")
    assert not (tmp_path / "elsewhere").exists() and not leftovers(tmp_path)


def test_a_failed_claim_leaves_no_parent_folders_behind(tmp_path):
    """--out a/b/run of a run that fails before writing: the folders a and b made for it are removed again; a
    parent that existed before, or that the run's output now lives in, stays."""
    (tmp_path / "kept").mkdir()
    with pytest.raises(RuntimeError):
        with claim_out_dir(tmp_path / "kept" / "a" / "b" / "run"):
            assert (tmp_path / "kept" / "a" / "b").is_dir()
            raise RuntimeError("the run failed")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["kept"]
    with claim_out_dir(tmp_path / "kept" / "a" / "b" / "run") as out:
        out.mkdir()
    assert (tmp_path / "kept" / "a" / "b" / "run").is_dir()


def test_a_lock_file_with_other_names_is_never_written(tmp_path):
    """A hard link planted at the lock's name shares its bytes with a file elsewhere: the pid would land there."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    os.link(victim, tmp_path / ".out.lock")
    with pytest.raises(OutputError, match="not a plain file of its own"):
        with locked(tmp_path / "out"):
            pass
    assert victim.read_text() == "precious\n"


def test_an_output_file_is_never_written_through_a_link(tmp_path):
    """The writers open their files without following links: one planted in a folder being written is refused."""
    victim = tmp_path / "victim.csv"
    victim.write_text("precious\n")
    (tmp_path / "summary.csv").symlink_to(victim)
    with pytest.raises(OSError) as e:
        write_csv(pd.DataFrame({"a": [1]}), tmp_path / "summary.csv")
    assert e.value.errno == errno.ELOOP and victim.read_text() == "precious\n"


def test_a_message_holds_no_control_characters():
    assert one_line("bad \x1b[2J value\r\nrun: forged\x07") == "bad \\x1b[2J value run: forged\\x07"
