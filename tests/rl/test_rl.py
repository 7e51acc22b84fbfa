"""divergence-probe rl: the task, GRPO's loss, and a few-step loop end to end (CLI and API)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from divergence_probe.cli import app
from divergence_probe.rl.grpo import group_advantages, policy_loss
from divergence_probe.rl.reward import RewardError, closes_brackets, load_reward
from test_compare_cli import assert_one_line_error

pytestmark = pytest.mark.engine  # every test here starts an engine or runs the tool in a child

REPO = Path(__file__).resolve().parents[2]
LIGER_RUNS = torch.cuda.is_available() and find_spec("liger_kernel") is not None  # the trainer kernel set's needs


def test_bracket_reward():
    assert closes_brackets("f(a, [1, ", "2])") == 1.0
    assert closes_brackets("f(a, [1, ", "2)]") == 0.0  # wrong closer
    assert closes_brackets("f(a, [1, ", "2]") == 0.0  # one left open
    assert closes_brackets("f(", ") + g(") == 0.0  # a new one left open
    assert closes_brackets("x = 1", "") == 1.0


def test_reward_plugin(tmp_path, monkeypatch):
    (tmp_path / "my_reward.py").write_text("def score(p, r):\n    return len(r)\n\ndef bad(p, r):\n    return 'x'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_reward("my_reward:score")("p", "abc") == 3
    for spec, message in [("my_reward", "module:function"), ("nope_module:f", "cannot import"),
                          ("my_reward:missing", "no function")]:
        with pytest.raises(RewardError, match=message):
            load_reward(spec)
    from divergence_probe.rl.reward import score

    with pytest.raises(RewardError, match="not a number"):
        score(load_reward("my_reward:bad"), "p", "r")


@pytest.mark.parametrize("steps, width", [(1, 1), (2, 1), (12, 6), (19, 9), (20, 10), (60, 10)])
def test_summary_start_and_end_never_share_a_step(steps, width):
    """A reward that falls every step reads as a fall in rl_summary.csv at any length: the start and the end average
    disjoint steps, named in the printed table."""
    from divergence_probe.numerics.rl_summary import summarize, window_label

    times = {k: 0.1 for k in ("t_rollout", "t_reward", "t_update", "t_metrics", "t_sync", "t_check")}
    rows = pd.DataFrame([{"setting": "none", "seed": 0, "step": s, "reward_mean": 1.0 - s / steps,
                          "mean_abs_dlogp": 1e-3 * s, "max_abs_dlogp": 1e-2 * s, "k3": 0.0, "ppo_clip_frac": 0.0,
                          "entropy": 1.0,
                          "grad_norm": 1.0, **times} for s in range(1, steps + 1)])
    row = summarize(rows).iloc[0]
    assert row.window == width and (steps < 2 or 2 * row.window <= steps)
    if steps > 1:
        assert row.reward_end < row.reward_start and row.mean_abs_dlogp_end > row.mean_abs_dlogp_start
    assert window_label(1, 20, 5) == "steps 1-5 -> steps 16-20" and window_label(1, 2, 1) == "step 1 -> step 2"


def _rl_folder(path, steps: int, seeds: int, fall: bool):
    """An rl run folder written by the rl command's own writer: a reward that falls (or rises) every step, a mismatch
    that grows, one row per (seed, step), the manifest the rl command records (its spec)."""
    from divergence_probe.spec.rl import RLSpec
    from divergence_probe.numerics.rl_summary import summarize
    from divergence_probe.rl.table import rl_folder

    times = {k: 0.1 for k in ("t_rollout", "t_reward", "t_update", "t_metrics", "t_sync", "t_check")}
    rows = [{"setting": "none", "seed": seed, "step": s, "reward_mean": (1 - s / steps if fall else s / steps) / (seed + 1),
             "mean_abs_dlogp": 1e-3 * s, "max_abs_dlogp": 1e-2, "k3": 1e-6, "ppo_clip_frac": 0.0, "entropy": 1.0,
             "grad_norm": 1.0, **times}
            for seed in range(seeds) for s in range(1, steps + 1)]
    with rl_folder(path) as writer:
        for row in rows:
            writer.add(row)
        writer.finish({"kind": "rl", "spec": RLSpec(steps=steps, seeds=seeds).to_dict(),
                       "model": {"spec": "builtin:default", "arch": "qwen3", "num_layers": 2}},
                      summarize(pd.DataFrame(rows)))
    return path


@pytest.mark.parametrize("fmt", ["md", "html", "latex"])
def test_rl_report_has_setup_verdict_band_and_every_format(tmp_path, fmt):
    from divergence_probe.reports.rl import write_rl_report

    run = _rl_folder(tmp_path / "run", steps=20, seeds=2, fall=True)
    main = write_rl_report(run, fmt=fmt)
    text = main.read_text()
    for needle in ("Setup", "builtin:default", "eager", "lr 0.001", "2 seed(s)", "20 GRPO step(s)",
                   "steps 1-10", "steps 11-20", "the reward fell in every seed", "the mismatch grew in every seed",
                   "min to max", "Noise floor", "no collapse in 2 seeds", "GRPO step"[:4]):
        assert needle in text, needle
    assert (main.parent / "figures" / "rl.pdf").is_file()
    if fmt == "latex":
        assert (main.parent / "rl_summary.tex").is_file()
    if fmt == "md":
        rising = write_rl_report(_rl_folder(tmp_path / "up", steps=12, seeds=1, fall=False)).read_text()
        assert "the reward rose" in rising and "steps 7-12" in rising


def test_group_advantages():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    adv = group_advantages(rewards, 4)
    assert torch.all(adv[4:] == 0)  # a group with one outcome carries no signal
    assert adv[0] > 0 > adv[1] and abs(float(adv[:4].sum())) < 1e-5


@pytest.mark.parametrize("correction", ["none", "tis", "mis"])
def test_policy_loss_pushes_logprobs_along_the_advantage(correction):
    lp_infer = torch.log(torch.tensor([[0.5, 0.2], [0.3, 0.3]]))
    lp_train = (lp_infer + 0.01).clone().requires_grad_(True)
    adv = torch.tensor([1.0, -1.0])
    loss, stats = policy_loss(lp_train, lp_infer, adv, torch.ones(2, 2), 0.2, correction, 2.0)
    loss.backward()
    assert torch.all(lp_train.grad[0] < 0) and torch.all(lp_train.grad[1] > 0)  # descent raises row 0, lowers row 1
    assert stats["correction_zeroed_frac"] == 0


def test_tis_caps_and_mis_masks_the_mismatch_weight():
    lp_infer = torch.log(torch.tensor([[0.1, 0.5]]))
    lp_train = torch.log(torch.tensor([[0.5, 0.5]])).requires_grad_(True)  # token 0: w = 5 > C = 2
    for correction, zeroed in (("tis", 0.0), ("mis", 0.5)):
        _, stats = policy_loss(lp_train, lp_infer, torch.tensor([1.0]), torch.ones(1, 2), 0.2, correction, 2.0)
        assert stats["correction_zeroed_frac"] == zeroed
    _, tis = policy_loss(lp_train, lp_infer, torch.tensor([1.0]), torch.ones(1, 2), 0.2, "tis", 2.0)
    assert tis["correction_weight_mean"] == pytest.approx((2.0 + 1.0) / 2)


@pytest.mark.parametrize("flags, message", [
    (["--group-size", "1"], "--group-size"),
    (["--align", "nope"], "unknown region"),
    (["--setting", "rope", "--align", "rope"], "--align and --setting"),
    (["--correction", "clip"], "--correction"),
    (["--no-signal-step", "maybe"], "--no-signal-step"),
    (["--reward", "no_such_reward_module:score"], "cannot import"),
    (["--prompts", "no/such/prompts.txt"], "no/such/prompts.txt"),
    (["--engine-args", '{"enable_prefix_caching": false}'], "prefix caching on"),
    (["--engine-args", "{oops"], "not valid JSON"),
    (["--model", "no/such/model"], "no/such/model"),
])
def test_bad_rl_flags_fail_before_loading(flags, message, tmp_path):
    result = CliRunner().invoke(app, ["rl", *flags, "--out", str(tmp_path / "x")])
    assert_one_line_error(result, message)
    assert not (tmp_path / "x").exists()


def test_every_rl_option_is_a_flag():
    from divergence_probe.spec.rl import RLSpec
    from divergence_probe.spec import flag_of

    result = CliRunner().invoke(app, ["rl", "--help"], terminal_width=400)
    assert result.exit_code == 0
    for f in RLSpec.option_fields():
        assert flag_of(f) in result.output, f.name
    assert RLSpec(setting=("none", "rope,swiglu")).settings == ("none", "rope,swiglu")


@pytest.mark.parametrize("settings, message", [
    (("train:kernels=vllm",), "without a backward"),
    (("none", "engine:kv_cache_dtype=fp8"), "run on different engines"),
    (("engine:quantization=fp8",), "re-quantize"),
    (("train:correction=clip",), "train:correction takes tis, mis"),
    (("train:correction=tis,train:correction=mis",), "sets train:correction twice"),
    (("engine:nope=1",), "not SIDE:KEY=VALUE of a known knob"),
    # checked as --train-kernels liger is, before loading: on this machine its device or its package is missing
    pytest.param(("none", "rope,train:kernels=liger"), "--setting 'rope,train:kernels=liger': --train-kernels liger ",
                 marks=pytest.mark.skipif(LIGER_RUNS, reason="liger runs here")),
])
def test_knob_settings_that_cannot_run_are_one_line(settings, message, tmp_path):
    result = CliRunner().invoke(app, ["rl", *[a for s in settings for a in ("--setting", s)], "--out",
                                      str(tmp_path / "x")])
    assert_one_line_error(result, message)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("settings, message", [
    (("rope,swiglu", "swiglu,rope"), "'swiglu,rope' is the setting 'rope,swiglu' again"),
    (("none", ""), "is the setting 'none' again"),
    (("rope,train:precision=amp", "train:precision=amp, rope,rope"), "the setting 'rope,train:precision=amp' again"),
    (("none", "none"), "^--setting 'none' is the setting 'none' given twice; give each setting once"),
])
def test_a_setting_given_twice_in_another_order_is_refused(settings, message):
    """Two runs of one name would be summarized as one setting of twice the runs: refused with the spec, before
    anything loads (the CLI prints a spec's ProbeError as one line, as for the knob settings above)."""
    from divergence_probe.errors import ProbeError
    from divergence_probe.spec.rl import RLSpec

    with pytest.raises(ProbeError, match=message):
        RLSpec(setting=settings)


def test_rows_of_one_setting_run_twice_are_refused(tmp_path):
    """A folder whose rl.csv holds a setting's step twice (made by a version that ran a setting given twice in
    another order under one name) is refused by every reader, not summarized as one run of twice the steps."""
    from divergence_probe.reports.rl_rows import ROW_COLUMNS, read_rows
    from divergence_probe.rundir import RunFolderError

    row = {c: 1 for c in ROW_COLUMNS} | {"setting": "rope,swiglu", "seed": 0}
    pd.DataFrame([row | {"step": 1}, row | {"step": 2}, row | {"step": 1}]).to_csv(tmp_path / "rl.csv", index=False)
    with pytest.raises(RunFolderError, match="holds step 1 of setting 'rope,swiglu', seed 0 twice"):
        read_rows(tmp_path, check=False)
    pd.DataFrame([row | {"step": 1}, row | {"step": 1, "seed": 1}]).to_csv(tmp_path / "rl.csv", index=False)
    assert len(read_rows(tmp_path, check=False)) == 2  # two seeds of one step: two runs


def test_knob_settings_are_named_canonically_and_share_one_engine():
    from divergence_probe.spec.rl import RLSpec, parse_setting

    arm = parse_setting("train:precision=amp,rope, engine:kv_cache_dtype=fp8,swiglu")
    assert arm.name == "rope,swiglu,engine:kv_cache_dtype=fp8,train:precision=amp"  # regions, then knobs by name
    assert arm.value("train:precision") == "amp" and arm.value("train:kernels") is None
    spec = RLSpec(setting=("engine:kv_cache_dtype=fp8", "rope,engine:kv_cache_dtype=fp8"))
    assert spec.engine_knobs == ("engine:kv_cache_dtype=fp8",)
    from divergence_probe.rl.loop import load_spec

    for text in ("swiglu,rope", "train:precision=amp,rmsnorm,train:kernels=liger", "none", "routing,rope",
                 "train:correction=tis,engine:kv_cache_dtype=fp8"):
        arm = parse_setting(text)
        assert parse_setting(arm.name) == arm  # the name is the whole setting: two distinct ones never share it
    compiled = RLSpec(side="train", setting=("engine:enforce_eager=false", "rope,engine:enforce_eager=false"))
    assert load_spec(compiled).engine == "compiled"  # the one engine the settings share is the one they name


@pytest.fixture(scope="module")
def rl_process(tmp_path_factory):
    """tests/rl_driver.py in a process of its own: the rl engine has prefix caching on, the session's has not."""
    root = tmp_path_factory.mktemp("rl")
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "rl_driver.py"), str(root)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    return root, json.loads(line.removeprefix("RESULT "))


def test_the_dense_task_learns_from_random_weights(qwen3_tiny, tmp_path):
    """--reward letters gives every group a signal on a random checkpoint (the bracket task gives none there), and
    GRPO climbs it within a dozen steps: the reward of the last steps is above that of the first."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "divergence_probe", "rl", "--model", str(qwen3_tiny), "--reward",
                           "letters", "--lr", "1e-2", "--steps", "12", "--max-new-tokens", "16", "--device", "cpu",
                           "--out", str(tmp_path / "rl")], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = pd.read_csv(tmp_path / "rl" / "rl.csv")
    assert (rows.groups_with_signal == 1.0).all()
    assert rows.reward_mean.tail(3).mean() > rows.reward_mean.head(3).mean() + 0.05


def test_cli_experiment_writes_rows_summary_manifest_and_report(rl_process):
    root, seen = rl_process
    assert seen["cli_exit"] == 0
    rows = pd.read_csv(root / "cli" / "rl.csv")
    assert list(zip(rows.setting, rows.step)) == [("none", 1), ("rope", 1)]
    for col in ("reward_mean", "reward_std", "entropy", "mean_abs_dlogp", "k3", "ratio_max", "ppo_clip_frac",
                "tis_truncated_frac", "mis_masked_frac", "ess", "grad_norm", "sync_tensors", "stale_probe_moved",
                "optimizer_stepped"):
        assert rows[col].notna().all(), col
    assert (rows.sync_changed > 0).all()
    summary = pd.read_csv(root / "cli" / "rl_summary.csv")
    assert list(summary.setting) == ["none", "rope"]
    manifest = json.loads((root / "cli" / "manifest.json").read_text())
    assert manifest["kind"] == "rl" and manifest["files"]["rl.csv"]["rows"] == 2
    assert manifest["stacks"]["infer"]["settings"]["enable_prefix_caching"] is True
    assert list(manifest["phases"]) == ["loading the engine and the trainer", "none seed 0", "rope seed 0"]
    assert all(seconds > 0 for seconds in manifest["phases"].values())  # each phase's seconds, the last one's too
    assert manifest["spec"]["no_signal_step"] == "step"
    assert (root / "cli" / "report" / "figures" / "rl.png").is_file()


def test_rerun_of_an_rl_folder_makes_the_same_rows(rl_process):
    """`rerun RL_RUN` replays the manifest's spec: the same steps, rewards, mismatch and checks, column for column
    (the timings aside), and the same spec recorded."""
    _, seen = rl_process
    assert seen["rerun_exit"] == 0
    assert seen["rerun_rows"] == 2 and seen["rerun_differs"] == []
    assert seen["rerun_spec_same"]


def test_api_rows_on_disk_per_step_and_weights_verified(rl_process):
    _, seen = rl_process
    assert seen["rows_on_disk_after_each_step"] == [[1, 1], [2, 2]]
    assert seen["sync_audited"] == [False, True]  # --audit-every 2: step 2's push also compared by sha256
    assert all(n > 30 for n in seen["sync_tensors"])  # every engine tensor compared after every push
    assert all(n > 0 for n in seen["sync_changed"])
    assert "model.layers.0.self_attn.q_proj.weight" in seen["weights_changed"]


def test_skipped_tensor_is_caught(rl_process):
    _, seen = rl_process
    assert seen["skipped_tensor"].startswith("SyncError") and "model.layers.1.mlp.gate_up_proj.weight" in seen["skipped_tensor"]
    assert "up_proj" in seen["skipped_tensor"]
    assert seen["restored_after_skip"] == "no error"  # the engine whole again before the sections after it


def test_a_nan_engine_logprob_is_refused_before_the_update(rl_process):
    """NaN among the rollout's engine logprobs stops the step before the update writes NaN into every trainer weight
    (which the weight check then reported as a push that missed the embedding: NaN != NaN)."""
    _, seen = rl_process
    assert seen["nan_logprob"].startswith("NumericsError") and "NaN or inf" in seen["nan_logprob"]
    assert seen["nan_logprob_weights_kept"]


def test_tied_head_left_to_vllms_reload_is_caught_where_it_is_stale(rl_process):
    """vLLM's reload alone leaves a tied head's own GEMM copy stale on CPUs whose GEMM packs one (AMX), and not on
    those that read the weight in place (the driver looks at what the head computes): the checksums name lm_head in
    the first case and must not raise a false alarm in the second."""
    _, seen = rl_process
    if seen["tied_head_stale"]:
        assert seen["tied_head_unfixed"].startswith("SyncError") and "lm_head.weight" in seen["tied_head_unfixed"]
    else:
        assert seen["tied_head_unfixed"] == "no error"


def test_stale_prefix_cache_fails_the_probe_and_keeps_the_rows(rl_process):
    _, seen = rl_process
    assert seen["stale_cache"].startswith("StaleCacheError")
    assert seen["stale_rows"] == 1 and not seen["stale_manifest"]


def test_probe_refuses_a_push_whose_positive_control_fails(rl_process):
    """The probe's blocks not cached before the push: a missing reset would go unseen, so the check is an error."""
    _, seen = rl_process
    assert seen["control_uncached"].startswith("SyncError") and "prefix cache" in seen["control_uncached"]
    assert "StaleCacheError" not in seen["control_uncached"]


def test_no_signal_step_skip_keeps_weights_and_step_moves_them(rl_process):
    _, seen = rl_process
    for mode in ("step", "skip"):
        run = seen[f"no_signal_{mode}"]
        assert run["first_signal"] > 0 and run["first_stepped"]  # AdamW has momentum before the no-signal step
        assert run["second_signal"] == 0
    assert seen["no_signal_step"]["second_stepped"] and seen["no_signal_step"]["changed"]
    assert seen["no_signal_step"]["sync_changed"] > 0
    assert not seen["no_signal_skip"]["second_stepped"]
    assert seen["no_signal_skip"]["changed"] == [] and seen["no_signal_skip"]["sync_changed"] == 0


def test_knob_settings_change_the_update_or_the_trainer_and_every_run_starts_with_its_floors(rl_process):
    _, seen = rl_process
    assert seen["knob_settings"] == ["train:correction=tis", "rope,train:precision=amp"]
    assert seen["knob_precisions"] == ["bf16", "amp"]  # the amp setting ran on a trainer loaded in AMP
    tis, plain = seen["knob_correction_weight"]
    assert tis != 1.0 and plain == 1.0  # TIS weights the loss by the mismatch; no correction weighs every token 1
    assert all(f >= 0 for row in seen["knob_floors"] for f in row)
    # the engine's floor is each sample rolled out alone against the step's batch: a known shift of one is what it reads
    assert seen["shifted_engine_floor"] == pytest.approx(0.01, rel=1e-3)


def test_rl_report_shows_the_setup_and_refuses_a_changed_rl_csv(rl_process, tmp_path):
    import shutil

    root, _ = rl_process
    run = tmp_path / "run"
    shutil.copytree(root / "cli", run, ignore=shutil.ignore_patterns("report"))
    runner = CliRunner()
    assert runner.invoke(app, ["report", str(run)]).exit_code == 0
    assert "`eager` mode" in (run / "report" / "report.md").read_text()  # the setup, from the real manifest
    with (run / "rl.csv").open("a") as f:
        f.write("none,0,3\n")
    assert_one_line_error(runner.invoke(app, ["report", str(run), "--out", str(tmp_path / "r2")]), "sha256")


@pytest.mark.parametrize("options, message", [
    (dict(engine="compiled", setting=("none", "rope")), "--engine compiled cannot align rope on the engine"),
    (dict(engine_args={"compilation_config": {"mode": 3}}), "compilation_config needs --engine compiled"),
    (dict(engine="jit"), "--engine 'jit' is not valid"),
])
def test_compiled_engine_options_that_cannot_work_are_refused(options, message):
    from divergence_probe.errors import ProbeError
    from divergence_probe.spec.rl import rl_spec

    with pytest.raises(ProbeError, match=message):
        rl_spec(**options)


def test_compiled_engine_takes_trainer_side_alignment_and_routing_replay():
    """Nothing of these is patched into the engine: the trainer alone is aligned, routes are replayed in the trainer."""
    from divergence_probe.spec.rl import rl_spec

    assert rl_spec(engine="compiled", side="train", setting=("none", "rope,swiglu,rmsnorm")).load.engine == "compiled"
    assert rl_spec(engine="compiled", setting=("none", "routing")).settings == ("none", "routing")
    # lm_head is patched outside the compiled graph (the logits processor runs as Python): side both takes it
    assert rl_spec(engine="compiled", side="both", setting=("none", "lm_head")).settings == ("none", "lm_head")
