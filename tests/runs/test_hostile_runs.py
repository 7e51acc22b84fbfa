"""A run folder is untrusted input: rerun runs no code a run folder names, writers replace only folders the
tool marked as its own output, paths in a run folder stay inside it, a recorded spec is checked like the CLI's flags,
and damaged folders are one line. Each refusal: exit code 2, one line on stderr, nothing written, nothing changed.

Rerun refusals are checked with divergence_probe.load replaced by a function that fails the test: they happen before
anything loads, so no vLLM engine starts. The one full rerun here runs `--infer hf` (two transformers instances).
"""

from __future__ import annotations

import errno
import gzip
import hashlib
import json
import os
import resource
import shutil
import signal
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

import divergence_probe
from divergence_probe.cli import app
from divergence_probe.engines.vllm.replayable import refused_engine_args
from divergence_probe.rundir import MARK, marked

from test_report import make_compare

SENTINEL = "code-from-the-run-folder-ran"
EVIL = f"""import pathlib
pathlib.Path(__file__).with_name({SENTINEL!r}).write_text("ran")
from transformers import Qwen3Config as EvilConfig, Qwen3ForCausalLM as EvilModel
from transformers import PreTrainedTokenizerFast as EvilTokenizer
"""


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args], terminal_width=400)


def assert_refused(result, *needles) -> str:
    """Exit code 2 and exactly one line on stderr, the tool's, holding every needle."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def snapshot(root: Path) -> dict[str, str]:
    """Every entry under root with its bytes' sha256 (or a link's target): what must not change."""
    found = {}
    for path in sorted(Path(root).rglob("*")):
        key = path.relative_to(root).as_posix()
        if path.is_symlink():
            found[key] = "link:" + os.readlink(path)
        elif path.is_file():
            found[key] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            found[key] = "dir" if path.is_dir() else "special"
    return found


def edit(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory, qwen3_tiny, prompts_file) -> Path:
    """One real compare run folder (transformers on both sides), copied by each test that edits it."""
    out = tmp_path_factory.mktemp("hostile-runs") / "base"
    result = invoke("compare", "--model", qwen3_tiny, "--prompts", prompts_file, "--infer", "hf", "--device", "cpu",
                    "-n", "1", "--taps", "none", "--out", out)
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture
def run(hf_run, tmp_path) -> Path:
    return Path(shutil.copytree(hf_run, tmp_path / "run"))


@pytest.fixture
def no_load(monkeypatch):
    """Fail the test if anything loads a model: every refusal here comes before that."""
    def load(*args, **kwargs):
        raise AssertionError("a model was loaded before the refusal")

    monkeypatch.setattr(divergence_probe, "load", load)
    monkeypatch.setattr(divergence_probe, "run", load)  # compare's and ablate's (the CLI's), either placement
    import divergence_probe.rl.experiment as rl_experiment

    monkeypatch.setattr(rl_experiment, "load", load)  # rl's engine and trainer


def evil_model(src: Path, dst: Path) -> Path:
    """A copy of checkpoint src whose config and tokenizer config name a module of the folder (auto_map), which
    writes SENTINEL beside itself when imported."""
    shutil.copytree(src, dst)
    (dst / "evil.py").write_text(EVIL)
    edit(dst / "config.json", lambda c: c.update(auto_map={"AutoConfig": "evil.EvilConfig",
                                                           "AutoModelForCausalLM": "evil.EvilModel"}))
    edit(dst / "tokenizer_config.json", lambda c: c.update(auto_map={"AutoTokenizer": [None, "evil.EvilTokenizer"]}))
    return dst


def point_at(run: Path, model: Path, **load) -> None:
    """Make run's manifest name `model` (with its config's sha256, as a forger would) and the given load fields."""
    def change(m):
        m["spec"]["load"].update(model=str(model), **load)
        m["model"]["config_sha256"] = hashlib.sha256((model / "config.json").read_bytes()).hexdigest()
    edit(run / "manifest.json", change)


# ---------------------------------------------------------------------------------------------- 1. no code runs
CODE_ARGS = [
    {"trust_remote_code": True},
    {"worker_cls": "evil.Worker"},
    {"scheduler_cls": "evil.Scheduler"},
    {"hf_overrides": {"architectures": ["EvilModel"]}},
    {"tokenizer": "/elsewhere/tokenizer"},
    {"logits_processors": ["evil.Processor"]},
    {"model_loader_extra_config": {"x": 1}},
    {"compilation_config": {"backend": "evil.backend"}},
    {"compilation_config": {"mode": 3, "inductor_passes": {"p": "evil.pass_"}}},
    {"compilation_config": {"inductor_compile_config": {"cpp.cxx": "/tmp/evil-cc"}}},
    {"compilation_config": {"cache_dir": "/tmp/evil-cache"}},
    {"max_num_seqs": "evil.seqs"},  # a replayed name with a value that is not a plain number or name
]


@pytest.mark.parametrize("engine_args", CODE_ARGS, ids=lambda a: "-".join(
    f"{k}.{next(iter(v))}" if isinstance(v, dict) and k == "compilation_config" else k for k, v in a.items()))
def test_rerun_refuses_engine_args_that_can_run_code(run, qwen3_tiny, tmp_path, no_load, engine_args):
    model = evil_model(qwen3_tiny, run / "model")  # shipped inside the run folder, as a forger would
    point_at(run, model, infer="vllm", engine="compiled", engine_args=engine_args)
    before = snapshot(tmp_path)
    (name,) = refused_engine_args(engine_args)
    line = assert_refused(invoke("rerun", run, "--out", tmp_path / "again"),
                          f"spec.load.engine_args.{name}", f"--allow-engine-arg {name}")
    assert "manifest.json" in line
    assert not (model / SENTINEL).exists()
    assert snapshot(tmp_path) == before  # nothing written, nothing changed


def test_rerun_replays_plain_engine_args_and_shows_what_will_run_before_loading(run, tmp_path, monkeypatch):
    plain = {"max_num_seqs": 4, "block_size": 16, "enable_prefix_caching": False, "gpu_memory_utilization": 0.2,
             "compilation_config": {"mode": 3, "cudagraph_mode": "PIECEWISE", "custom_ops": ["+rms_norm"],
                                    "pass_config": {"eliminate_noops": True}}}
    assert refused_engine_args(plain) == []
    assert refused_engine_args({"trust_remote_code": True, "compilation_config": {"backend": "x.y"}},
                               allowed=("trust_remote_code", "compilation_config.backend")) == []

    from divergence_probe.errors import ProbeError

    def load(*args, **kwargs):
        raise ProbeError("stopped where the model would load")

    monkeypatch.setattr(divergence_probe, "load", load)
    monkeypatch.setattr(divergence_probe, "run", load)  # compare's and ablate's (the CLI's), either placement
    import divergence_probe.rl.experiment as rl_experiment

    monkeypatch.setattr(rl_experiment, "load", load)  # rl's engine and trainer
    edit(run / "manifest.json", lambda m: m["spec"]["load"].update(infer="vllm", engine_args={"trust_remote_code": True}))
    monkeypatch.setattr("divergence_probe.engines.vllm.args.check_engine_args", lambda *a, **k: None)  # no vLLM import
    result = invoke("rerun", run, "--allow-engine-arg", "trust_remote_code", "--out", tmp_path / "again")
    assert_refused(result, "stopped where the model would load")  # the flag let it through to the load
    plan = result.stdout
    assert "rerun: compare of model" in plan and '"trust_remote_code": true' in plan
    assert "same as: divergence-probe compare --model" in plan and "--engine-args" in plan and "--device cpu" in plan
    assert not (tmp_path / "again").exists()


def test_training_side_never_runs_a_model_folders_code(run, qwen3_tiny, tmp_path):
    model = evil_model(qwen3_tiny, tmp_path / "model")
    point_at(run, model)  # --infer hf: transformers on both sides
    result = invoke("rerun", run, "--out", tmp_path / "again")
    assert result.exit_code == 0, result.output
    assert not (model / SENTINEL).exists()
    assert (tmp_path / "again" / "summary.csv").is_file()


# ---------------------------------------------------------------------------------------------- 2. no data loss
def make_rl(path: Path) -> Path:
    """An rl run folder written by the rl command's own writer (rl/table.py)."""
    from divergence_probe.numerics.rl_summary import summarize
    from divergence_probe.rl.table import rl_folder

    times = {k: 0.1 for k in ("t_rollout", "t_reward", "t_update", "t_metrics", "t_sync", "t_check")}
    rows = [{"setting": "plain", "seed": 0, "step": step, "reward_mean": 0.1 * step, "mean_abs_dlogp": 1e-3,
             "max_abs_dlogp": 1e-2, "k3": 1e-6, "ppo_clip_frac": 0.0, "entropy": 2.0, "grad_norm": 1.0, **times} for step in range(1, 4)]
    with rl_folder(path) as writer:
        for row in rows:
            writer.add(row)
        writer.finish({"kind": "rl"}, summarize(pd.DataFrame(rows)))
    return path


def users_folder(path: Path, forged_mark: bool = False) -> Path:
    path.mkdir()
    (path / "report.md").write_text("my notes, not a report")
    (path / "data.csv").write_text("a,b\n1,2\n")
    (path / "sub").mkdir()
    (path / "sub" / "keep.txt").write_text("keep")
    if forged_mark:  # a mark that lists only report.md: the other files are still the user's
        (path / MARK).write_text(json.dumps({"tool": "divergence-probe", "output": "report", "files": ["report.md"]}))
    return path


@pytest.mark.parametrize("kind", ["rl", "compare"])
@pytest.mark.parametrize("forged_mark", [False, True])
def test_report_never_replaces_a_folder_the_tool_did_not_mark(tmp_path, kind, forged_mark):
    source = make_rl(tmp_path / "rl") if kind == "rl" else make_compare(tmp_path / "run")
    mine = users_folder(tmp_path / "mine", forged_mark)
    before = snapshot(tmp_path)
    assert_refused(invoke("report", source, "--out", mine), str(mine), "other than a previous report")
    assert snapshot(tmp_path) == before


def test_report_never_replaces_a_users_folder_through_a_link(tmp_path):
    run = make_compare(tmp_path / "run")
    mine = users_folder(tmp_path / "mine")
    files = sorted(p.relative_to(mine).as_posix() for p in mine.rglob("*") if p.is_file())
    (mine / MARK).write_text(json.dumps({"tool": "divergence-probe", "output": "report", "files": files}))
    (run / "report").symlink_to(mine)  # the default --out of a shared run folder, pointing at the user's files
    before = snapshot(tmp_path)
    assert_refused(invoke("report", run), str(run / "report"), "is a link")
    assert snapshot(tmp_path) == before


def test_report_replaces_its_own_previous_report_and_refuses_other_outputs(tmp_path):
    rl = make_rl(tmp_path / "rl")
    assert json.loads((rl / MARK).read_text())["output"] == "rl"  # claimed as the tool's at its start
    assert invoke("report", rl).exit_code == 0
    assert marked(rl / "report", "report")
    assert invoke("report", rl).exit_code == 0  # a re-render replaces the previous report
    other = make_compare(tmp_path / "run")
    before = snapshot(tmp_path)
    assert_refused(invoke("report", other, "--out", rl), "other than a previous report")  # an rl run is no report
    assert snapshot(tmp_path) == before


def test_make_model_overwrites_only_a_checkpoint_it_wrote(tmp_path, qwen3_tiny):
    foreign = Path(shutil.copytree(qwen3_tiny, tmp_path / "foreign"))  # has config.json, but no mark
    (foreign / MARK).unlink(missing_ok=True)
    (foreign / "notes.txt").write_text("mine")
    made = tmp_path / "made"
    assert invoke("make-model", made).exit_code == 0 and marked(made, "model")
    (made / "notes.txt").write_text("mine too")  # added by the user after make-model
    before = snapshot(tmp_path)
    for folder in (foreign, made):
        assert_refused(invoke("make-model", folder, "--overwrite"), str(folder), "will not overwrite it")
    assert snapshot(tmp_path) == before
    (made / "notes.txt").unlink()
    assert invoke("make-model", made, "--overwrite", "--seed", "1").exit_code == 0  # its own checkpoint: replaced


# ---------------------------------------------------------------------------------------------- 3. paths stay inside
def _list(run: Path, name: str, data: bytes) -> None:
    edit(run / "manifest.json", lambda m: m.setdefault("files", {}).update({name: {"rows": 1, "sha256": hashlib.sha256(data).hexdigest()}}))


@pytest.mark.parametrize("how", ["dotdot", "absolute", "link-out", "summary-link"])
def test_report_reads_no_path_outside_the_run_folder(tmp_path, how):
    run = make_compare(tmp_path / "run")
    outside = tmp_path / "secret.csv"
    outside.write_text("a\n1\n")
    if how == "dotdot":
        _list(run, "../secret.csv", outside.read_bytes())
    elif how == "absolute":
        _list(run, str(outside), outside.read_bytes())
    elif how == "link-out":
        (run / "buckets.csv").symlink_to(outside)
        _list(run, "buckets.csv", outside.read_bytes())
    else:
        shutil.copy(run / "summary.csv", tmp_path / "summary-copy.csv")
        (run / "summary.csv").unlink()
        (run / "summary.csv").symlink_to(tmp_path / "summary-copy.csv")
    before = snapshot(tmp_path)
    assert_refused(invoke("report", run), "run folder holds its own files")
    assert snapshot(tmp_path) == before and not (run / "report").exists()


def test_a_linked_run_folder_is_the_folder_it_names(tmp_path):
    run = make_compare(tmp_path / "run")
    (tmp_path / "link").symlink_to(run)
    assert invoke("report", tmp_path / "link").exit_code == 0
    assert (run / "report" / "report.md").is_file()


# ---------------------------------------------------------------------------------------------- 4. spec checked
BAD_SPECS = [
    (lambda s: s["prompts"].update(num_prompts=2.5), "spec.prompts.num_prompts (--num-prompts) is 2.5"),
    (lambda s: s["prompts"].update(num_prompts=10**30), "spec.prompts.num_prompts"),
    (lambda s: s["capture"].update(batch_invariance="yes"), "spec.capture.batch_invariance (--batch-invariance)"),
    (lambda s: s["load"].update(batch_tokens=[8192]), "spec.load.batch_tokens (--batch-tokens) is [8192]"),
    (lambda s: s["load"].update(dtype=16), "spec.load.dtype (--dtype) is 16"),
    (lambda s: s["capture"].update(taps="resid_out,warp_core"), "spec.capture: unknown tap name(s) warp_core"),
    (lambda s: s["capture"].update(threshold=float("nan")), "spec.capture.threshold (--threshold) is nan"),
    (lambda s: s["load"].update(warp_drive=True), "unknown field(s) spec.load.warp_drive"),
    (lambda s: s["load"].pop("seed"), "spec.load lacks the field(s) seed"),
    (lambda s: s.update(capture=[1, 2]), "spec.capture is list, not a JSON object"),
    (lambda s: s["prompts"].update(num_prompts=0), "spec.prompts: --num-prompts must be at least 1"),
]


@pytest.mark.parametrize("change, needle", BAD_SPECS, ids=[n.split(" ")[0] + f"-{i}" for i, (_, n) in enumerate(BAD_SPECS)])
def test_rerun_checks_every_spec_field_before_loading(run, tmp_path, no_load, change, needle):
    edit(run / "manifest.json", lambda m: change(m["spec"]))
    before = snapshot(tmp_path)
    assert_refused(invoke("rerun", run, "--out", tmp_path / "again"), needle, "manifest.json")
    assert snapshot(tmp_path) == before


def test_rerun_refuses_a_spec_that_is_not_an_object(run, tmp_path, no_load):
    edit(run / "manifest.json", lambda m: m.update(spec="compare everything"))
    assert_refused(invoke("rerun", run, "--out", tmp_path / "again"), "spec is str, not a JSON object")
    assert not (tmp_path / "again").exists()


# ---------------------------------------------------------------------------------------------- 5. damaged folders
def _cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])


def _rehash(run: Path, name: str) -> None:
    edit(run / "manifest.json", lambda m: m["files"][name].update(sha256=hashlib.sha256((run / name).read_bytes()).hexdigest()))


def _rl_without_column(run: Path) -> None:
    rows = pd.read_csv(run / "rl.csv").drop(columns=["mean_abs_dlogp"])
    rows.to_csv(run / "rl.csv", index=False)
    _rehash(run, "rl.csv")


def _rl_not_numbers(run: Path) -> None:
    rows = pd.read_csv(run / "rl.csv")
    rows["reward_mean"] = "lots"
    rows.to_csv(run / "rl.csv", index=False)
    _rehash(run, "rl.csv")


DAMAGE = {
    "rl-manifest-cut": (make_rl, lambda r: _cut(r / "manifest.json"), "manifest.json"),
    "rl-manifest-list": (make_rl, lambda r: (r / "manifest.json").write_text("[1, 2]"), "not a JSON object"),
    "rl-manifest-no-files": (make_rl, lambda r: edit(r / "manifest.json", lambda m: m.pop("files")), "`files`"),
    "rl-csv-lacks-column": (make_rl, _rl_without_column, "lacks the column(s) mean_abs_dlogp"),
    "rl-csv-not-numbers": (make_rl, _rl_not_numbers, "column reward_mean holds"),
    "rl-summary-changed": (make_rl, lambda r: (r / "rl_summary.csv").write_text("setting,seed\nx,0\n"), "sha256"),
    "compare-manifest-cut": (make_compare, lambda r: _cut(r / "manifest.json"), "manifest.json"),
    "compare-manifest-list": (make_compare, lambda r: (r / "manifest.json").write_text("[]"), "not a JSON object"),
    "compare-model-not-object": (make_compare, lambda r: edit(r / "manifest.json", lambda m: m.update(model=5)), "`model`"),
    "compare-stack-not-object": (make_compare, lambda r: edit(r / "manifest.json", lambda m: m.update(
        stacks={"infer": [], "train": {}})), "`stacks.infer`"),
    "compare-manifest-huge-int": (make_compare, lambda r: (r / "manifest.json").write_text(
        '{"kind": "compare", "files": {}, "x": ' + "9" * 5000 + "}"), "manifest.json"),
    "compare-manifest-deep": (make_compare, lambda r: (r / "manifest.json").write_text("[" * 200000), "manifest.json"),
    "compare-manifest-huge": (make_compare, lambda r: (r / "manifest.json").write_text(
        '{"kind": "compare", "pad": "' + " " * (17 * 2**20) + '"}'), "larger than"),
    "compare-manifest-link": (make_compare, lambda r: (
        shutil.move(r / "manifest.json", r.parent / "m.json"), (r / "manifest.json").symlink_to(r.parent / "m.json")),
        "is a link"),
}


@pytest.mark.parametrize("name", DAMAGE)
def test_report_on_a_damaged_folder_is_one_line(tmp_path, name):
    make, damage, needle = DAMAGE[name]
    run = make(tmp_path / "run")
    damage(run)
    before = snapshot(tmp_path)
    assert_refused(invoke("report", run), needle)
    assert snapshot(tmp_path) == before  # no report folder, no hidden partial folder


@pytest.mark.engine  # the CLI in a child process, under an address-space cap
def test_a_tokens_file_that_expands_past_the_bound_is_one_line_in_a_capped_process(tmp_path):
    """A run folder's tokens.csv.gz of a few MB that decompresses to GBs: `report` reads no further than the bound
    on a run folder's file, within an address space capped at 3 GiB (reading it whole would take 4 GiB)."""
    import subprocess
    import sys

    from divergence_probe.run_folder import FILE_LIMIT

    run = make_compare(tmp_path / "run", tokens_as="gz")
    member = gzip.compress(b"0" * 2**20)
    with (run / "tokens.csv.gz").open("wb") as f:
        for _ in range(4096):
            f.write(member)
    before = snapshot(tmp_path)
    cap = 3 * 2**30
    proc = subprocess.run([sys.executable, "-m", "divergence_probe", "report", str(run)], text=True,
                          capture_output=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(Path(divergence_probe.__file__).parents[1])},
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (cap, cap)))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: "), proc.stderr[-2000:]
    assert f"holds over {FILE_LIMIT // 2**30} GiB once decompressed" in proc.stderr, proc.stderr
    assert snapshot(tmp_path) == before


def test_report_out_on_a_mount_point_unwritable_place_or_full_disk_is_one_line(tmp_path, monkeypatch):
    run = make_compare(tmp_path / "run")
    mount = tmp_path / "mnt"
    mount.mkdir()
    real_ismount = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: Path(p) == mount or real_ismount(p))
    before = snapshot(tmp_path)
    assert_refused(invoke("report", run, "--out", mount), "is a mount point", str(mount / "run"))
    assert_refused(invoke("report", run, "--out", "/proc/divergence-probe-report"), "choose a writable --out")

    from divergence_probe.reports import figures

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(figures, "save", full)
    assert_refused(invoke("report", run, "--out", tmp_path / "out"), "No space left on device", "free space there")
    assert snapshot(tmp_path) == before


# ---------------------------------------------------------------------------------------------- 6. other hostile cases
def test_rerun_refuses_a_prompts_path_that_is_a_pipe(run, tmp_path, no_load):
    fifo = tmp_path / "prompts.txt"
    os.mkfifo(fifo)
    edit(run / "manifest.json", lambda m: m["spec"]["prompts"].update(prompts=str(fifo)))

    def hung(*args):
        raise AssertionError("rerun opened the pipe and waited on it")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(120)
    try:
        result = invoke("rerun", run, "--out", tmp_path / "again")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert_refused(result, "is not a regular file or folder", str(fifo))
    assert not (tmp_path / "again").exists()


def rl_with_spec(path: Path, **changes) -> Path:
    """make_rl's folder whose manifest records an rl spec (RLSpec's defaults, then `changes`; a change of its load or
    its prompts, a dict, is merged into theirs), as a forger would."""
    from divergence_probe.spec.rl import PARTS, RLSpec

    spec = json.loads(json.dumps(RLSpec().to_dict()))
    spec.update({k: {**spec[k], **v} if k in PARTS else v for k, v in changes.items()})
    run = make_rl(path)
    edit(run / "manifest.json", lambda m: m.update(spec=spec))
    return run


RL_REFUSALS = {
    "no-spec": (lambda p: make_rl(p), "lacks the recorded rl spec"),
    "reward-plugin": (lambda p: rl_with_spec(p, reward="evil_rewards:score"), "spec.reward"),
    "engine-arg-code": (lambda p: rl_with_spec(p, load={"engine_args": {"worker_cls": "evil.Worker"}}),
                        "spec.load.engine_args.worker_cls"),
    "unknown-field": (lambda p: rl_with_spec(p, warp_drive=True), "unknown field(s) spec.warp_drive"),
    "bad-value": (lambda p: rl_with_spec(p, steps=0), "--steps must be from 1"),
    "wrong-type": (lambda p: rl_with_spec(p, seeds="many"), "spec.seeds (--seeds) is 'many'"),
    "prompts-unrecorded": (lambda p: rl_with_spec(p, prompts={"prompts": str(p.parent / "prompts.txt")}),
                           "rl.prompt_files_sha256"),
    "rows-changed": (lambda p: (rl_with_spec(p), (p / "rl.csv").open("a").write("plain,0,4\n")), "sha256"),
    "not-finished": (lambda p: (rl_with_spec(p), (p / "manifest.json").unlink()), "did not finish"),
}


@pytest.mark.parametrize("name", RL_REFUSALS)
def test_rerun_of_an_rl_folder_checks_its_manifest_before_loading(tmp_path, no_load, name):
    """An rl manifest is untrusted as compare's is: every spec field checked, code-loading engine args and reward
    plug-ins refused, the rows the manifest hashed, before any engine starts."""
    make, needle = RL_REFUSALS[name]
    (tmp_path / "prompts.txt").write_text("Close this: (\n")
    make(tmp_path / "rl")
    before = snapshot(tmp_path)
    assert_refused(invoke("rerun", tmp_path / "rl", "--out", tmp_path / "again"), needle)
    assert not (tmp_path / "evil_rewards.py").exists()
    assert snapshot(tmp_path) == before


def test_every_engine_arg_rerun_replays_is_one_vllm_takes():
    """The allow-list names real keywords of this vLLM (a renamed one would be refused, never silently passed)."""
    import dataclasses

    from divergence_probe.engines.vllm.replayable import COMPILATION_REPLAYED, REPLAYED
    from divergence_probe.engines.vllm.args import _import_vllm, _llm_keywords

    vllm = _import_vllm()  # as the tool imports it: the trainer's torch state is recorded first
    from vllm.config import CompilationConfig

    assert REPLAYED <= _llm_keywords(vllm), REPLAYED - _llm_keywords(vllm)
    compilation = {f.name for f in dataclasses.fields(CompilationConfig)}
    assert COMPILATION_REPLAYED <= compilation, COMPILATION_REPLAYED - compilation


# ---------------------------------------------------------------------------------------------- 7. no write through links
def _writer_argv(command: str, tmp_path: Path, qwen3_tiny, prompts_file, rerun_source) -> tuple[list, Path]:
    """(argv, the folder it writes) of one writer, aimed into tmp_path/shared, each on its cheapest path: every
    refusal below comes before anything loads."""
    shared = tmp_path / "shared"
    shared.mkdir(exist_ok=True)
    out = shared / "out"
    model = ["--model", qwen3_tiny, "--infer", "hf", "--device", "cpu"]
    if command == "report":
        run = make_compare(shared / "run")
        return ["report", run], run / "report"
    argv = {"compare": ["compare", *model, "--prompts", prompts_file],
            "ablate": ["ablate", *model, "--prompts", prompts_file, "--regions", "rope"],
            "score": ["score", tmp_path / "rollouts.jsonl", "--model", qwen3_tiny],
            "rerun": ["rerun", rerun_source],
            "rl": ["rl", "--model", qwen3_tiny, "--steps", "1"],
            "make-model": ["make-model"]}[command]
    return ([*argv, out] if command == "make-model" else [*argv, "--out", out]), out


WRITERS = ["compare", "ablate", "score", "report", "rerun", "rl"]


@pytest.mark.parametrize("dangling", [False, True], ids=["to-a-file", "dangling"])
@pytest.mark.parametrize("command", WRITERS)
def test_a_link_planted_as_the_lock_file_is_never_followed(command, dangling, run, tmp_path, qwen3_tiny, prompts_file,
                                                           no_load):
    argv, out = _writer_argv(command, tmp_path, qwen3_tiny, prompts_file, run)
    victim = tmp_path / ("nowhere" if dangling else "victim")
    if not dangling:
        victim.write_text("precious\n")
    lock = out.parent / f".{out.name}.lock"
    lock.symlink_to(os.path.relpath(victim, lock.parent))
    before = snapshot(tmp_path)
    assert_refused(invoke(*argv), str(lock), "is a link")
    assert snapshot(tmp_path) == before  # the victim unchanged (or still absent), no output, no partial folder


@pytest.mark.parametrize("command", [*WRITERS, "make-model"])
def test_out_that_is_a_link_is_refused_before_anything_runs(command, run, tmp_path, qwen3_tiny, prompts_file, no_load):
    argv, out = _writer_argv(command, tmp_path, qwen3_tiny, prompts_file, run)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out.symlink_to(elsewhere)
    before = snapshot(tmp_path)
    assert_refused(invoke(*argv), str(out), "is a link")
    assert snapshot(tmp_path) == before and not any(elsewhere.iterdir())


def test_rerun_shows_the_manifests_strings_escaped(run, tmp_path, no_load):
    """A tampered manifest's escape sequences and line breaks cannot clear the screen or forge a line of the preview."""
    forged = "\x1b[2J\x1b[H\nrun: /home/you/trusted-run\n  same as: divergence-probe compare"
    edit(run / "manifest.json", lambda m: m["spec"]["prompts"].update(prompts=forged))
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "x").write_text("x")  # a refusal after the preview: nothing loads
    result = invoke("rerun", run, "--out", taken)
    assert "\x1b" not in result.output and "\x1b" not in result.stderr
    assert "\\x1b[2J" in result.stdout and "\\nrun: /home/you/trusted-run" in result.stdout
    assert not any(line.startswith(("run:", "  same as: divergence-probe compare\n")) for line in result.stdout.splitlines())
    assert len(result.stdout.splitlines()) == 4  # the preview's own four lines


def test_a_swapped_prompt_file_is_caught_before_rerun_writes(toy, qwen3_tiny, prompts_file, tmp_path, monkeypatch):
    """rerun checks the prompt files before anything loads and again on the bytes the run read: a file replaced in
    between makes no run recorded as if made of the original prompts."""
    import divergence_probe.runs.loading as loading

    prompts = tmp_path / "prompts.txt"
    prompts.write_text(prompts_file.read_text())
    args = ["--model", qwen3_tiny, "--infer", "toy-fused", "--train", "toy", "--prompts", prompts, "--taps", "none"]
    assert invoke("compare", *args, "--out", tmp_path / "first").exit_code == 0
    load_run_prompts = loading.load_run_prompts

    def swapped(*a, **kw):  # called once, right after rerun's check and before the stacks load: the run's one read
        if not swapped.done:
            prompts.write_text(prompts_file.read_text() + "\n\nanother prompt\n")
            swapped.done = True
        return load_run_prompts(*a, **kw)

    swapped.done = False
    monkeypatch.setattr(loading, "load_run_prompts", swapped)
    assert_refused(invoke("rerun", tmp_path / "first", "--out", tmp_path / "again"), "changed since")
    assert not (tmp_path / "again").exists()


def test_the_manifest_hashes_the_prompt_bytes_the_run_read(toy, qwen3_tiny, prompts_file, tmp_path, monkeypatch):
    import divergence_probe.runs.compare as compare

    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(prompts_file.read_bytes())
    read = hashlib.sha256(prompts.read_bytes()).hexdigest()
    capturable = compare.capturable_taps

    def swapped(*a, **kw):
        prompts.write_text("a prompt nobody scored\n")
        return capturable(*a, **kw)

    monkeypatch.setattr(compare, "capturable_taps", swapped)
    args = ["--model", qwen3_tiny, "--infer", "toy-fused", "--train", "toy", "--prompts", prompts, "--taps", "none"]
    assert invoke("compare", *args, "--out", tmp_path / "run").exit_code == 0
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["compare"]["prompt_files_sha256"] == {"prompts.txt": read}


# ---------------------------------------------------------------------------------------------- 8. numbers a rerun takes
@pytest.mark.parametrize("argv, needle", [
    (["score", "r.jsonl", "--temperature", "inf"], "--temperature is inf"),
    (["score", "r.jsonl", "--tis-cap", "inf"], "--tis-cap is inf"),
    (["score", "r.jsonl", "--clip-eps", "nan"], "--clip-eps is nan"),
    (["compare", "--threshold", "inf"], "--threshold is inf"),
    (["compare", "--mode", "generate", "--tis-cap", "inf"], "--tis-cap is inf"),
    (["ablate", "--ci-level", "nan"], "--ci-level is nan"),
])
def test_a_number_rerun_would_refuse_is_refused_as_a_flag(argv, needle, tmp_path, no_load):
    before = snapshot(tmp_path)
    assert_refused(invoke(*argv, "--out", tmp_path / "out"), needle, "finite number")
    assert snapshot(tmp_path) == before


def _as_score(run: Path, clip_eps) -> None:
    """make_generate's folder as a score run whose manifest records clip_eps."""
    tokens = pd.read_csv(run / "tokens.csv").rename(columns={"logprob_infer": "logprob_rollout"})
    tokens.to_csv(run / "tokens.csv", index=False, lineterminator="\n")
    edit(run / "manifest.json", lambda m: m.update(kind="score", score={"clip_eps": clip_eps}))


@pytest.mark.parametrize("value", ["abc", [1], 1e308, float("inf")], ids=["text", "list", "huge", "inf"])
@pytest.mark.parametrize("where", ["score.clip_eps", "generate.clip_eps", "ablate.ci_level"])
def test_report_checks_the_manifests_numbers_as_their_flags(where, value, tmp_path):
    from test_report import make_ablate, make_generate

    section, name = where.split(".")
    if section == "ablate":
        run = make_ablate(tmp_path / "run")
        edit(run / "manifest.json", lambda m: m["ablate"].update(ci_level=value))
    else:
        run = make_generate(tmp_path / "run")
        if section == "score":
            _as_score(run, value)
        else:
            edit(run / "manifest.json", lambda m: m["generate"].update(clip_eps=value))
    before = snapshot(tmp_path)
    assert_refused(invoke("report", run), where)
    assert snapshot(tmp_path) == before
