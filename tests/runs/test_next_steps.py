"""The closing lines of a run (runs/next_steps.py): the run folder, the report and the next command, from the run's own
numbers; the suggested commands run as printed."""

from __future__ import annotations

import math
import shlex
from dataclasses import replace

import pandas as pd
import pytest
from typer.testing import CliRunner

from divergence_probe.cli import app
from divergence_probe.models import get_family
from divergence_probe.runs.next_steps import NUMERIC_REGIONS, after_ablate, after_compare, after_rl, after_score
from divergence_probe.numerics.noise_verdict import ABOVE, CANNOT_TELL, FLOOR_KIND, FLOOR_USED, PROMPTS, RATIO, TOO_FEW, \
    VERDICT, WITHIN, as_read, floor_columns, floor_moved, in_words, manifest_record, verdict
from divergence_probe.numerics.tables import NOISE, SYSTEMATIC
from divergence_probe.spec.rl import RLSpec, rl_spec
from divergence_probe.numerics.rl_summary import SEEDS_NEEDED, with_comparison
from divergence_probe.numerics.shapley import ADDS, ALL_REGIONS, CHANGE, EFFECT, MIN_PROMPTS, NO_INTERVAL, NOT_DETECTED, \
    REMOVES, bootstrap
from divergence_probe.spec.score import ScoreSpec
from divergence_probe.spec import LoadSpec, spec_from_flat


def closing(output: str) -> dict[str, str]:
    """The closing lines of a command's output, by their label (run, report, next, why)."""
    lines = {}
    for line in output.splitlines():
        label, sep, rest = line.strip().partition(": ")
        if sep and label in ("run", "report", "next", "why"):
            lines[label] = rest
    return lines


def invoke(argv):
    result = CliRunner().invoke(app, argv, terminal_width=400)
    assert result.exit_code == 0, result.output
    return result


def test_compare_names_its_folder_report_and_a_next_command_that_runs(toy_args, tmp_path):
    """No floor measured: the next command is the same compare with --batch-invariance; it runs as printed, and
    after it (a mismatch over its floor of 0: the toy stacks are batch-invariant) comes remedies."""
    first = tmp_path / "first"
    lines = closing(invoke(["compare", *map(str, toy_args), "--taps", "none", "--out", str(first)]).output)
    assert lines["run"] == str(first)
    assert shlex.split(lines["report"]) == ["divergence-probe", "report", str(first)]
    argv = shlex.split(lines["next"])
    assert argv[:2] == ["divergence-probe", "compare"] and "--batch-invariance" in argv and "noise" in lines["why"]
    invoke(shlex.split(lines["report"])[1:])
    assert (first / "report" / "report.md").is_file()
    lines = closing(invoke(argv[1:] + ["--out", str(tmp_path / "second")]).output)
    assert shlex.split(lines["next"])[:2] == ["divergence-probe", "remedies"] and "noise floor" in lines["why"]


def _compare(**flags):
    return spec_from_flat("compare", **flags)


FLOOR = {"noise_infer_mean_abs_dlogp": 1e-3, "noise_train_mean_abs_dlogp": 2e-3}


def _measured(mismatch: float, spread: float = 0.1, **extra) -> dict:
    """A summary with the floor, the ratio to the largest (2e-3) and an interval of ±spread around it."""
    ratio = mismatch / 2e-3
    low, high = ratio * (1 - spread), ratio * (1 + spread)
    return {**FLOOR, "mean_abs_dlogp": mismatch, RATIO: ratio, RATIO + "_ci_low": low, RATIO + "_ci_high": high,
            VERDICT: verdict(low, high), **extra}


def test_after_compare_follows_the_recipes():
    spec = _compare(taps="none", batch_invariance=True)
    within = after_compare(spec, _measured(1e-3))
    assert "--mode generate" in shlex.join(within.argv) and "within" in within.why
    assert after_compare(_compare(mode="generate", batch_invariance=True), _measured(1e-3)) is None
    # over its floor: which remedy removes it and what it costs, on the same model and prompts
    over = after_compare(_compare(taps="none", batch_invariance=True, num_prompts=30), _measured(8e-3))
    assert over.argv[:2] == ["divergence-probe", "remedies"] and "--num-prompts" in over.argv
    assert "--batch-invariance" not in over.argv and "what it costs" in over.why
    assert ("4x its largest floor (the training stack's own batch change, a noise floor; 95% interval over prompts "
            "3.6x to 4.4x, the floor's prompts resampled with the mismatch's)") in over.why
    moe = after_compare(spec, _measured(8e-3, frac_tokens_any_flip=0.1), get_family("qwen3_moe"))
    assert moe.argv[:2] == ["divergence-probe", "remedies"]  # its routing arms split routing from rounding
    # where remedies cannot run (one stack at a time), what ablate can: which region removes it
    apart = after_compare(_compare(taps="none", batch_invariance=True, placement="alternate"), _measured(8e-3))
    assert apart.argv[:2] == ["divergence-probe", "ablate"] and "routing" not in shlex.join(apart.argv)
    # a remedies run ends with its own ranking
    assert after_compare(spec_from_flat("remedies"), _measured(8e-3)) is None


def test_a_ratio_over_1_whose_interval_straddles_1_asks_for_more_prompts_not_for_a_cause():
    """The verdict follows the interval: a point ratio of 1.1 with an interval from 0.8 is no finding."""
    straddles = _measured(2.2e-3, spread=0.3)
    assert straddles[RATIO] > 1 and straddles[VERDICT] == CANNOT_TELL
    step = after_compare(_compare(taps="none", batch_invariance=True, num_prompts=8), straddles)
    assert shlex.join(step.argv).count("--num-prompts 32") == 1 and "--graft" not in step.argv
    assert "cannot tell" in step.why and "more prompts" in step.why
    # every prompt already used: no command can add more; the verdict's words say what would settle it
    assert after_compare(_compare(taps="none", batch_invariance=True), straddles) is None
    assert verdict(1.01, 2.0) == ABOVE and verdict(0.5, 1.0) == WITHIN and verdict(0.99, 1.2) == CANNOT_TELL


def _tokens(per_prompt: list[float]) -> pd.DataFrame:
    """Five tokens a prompt, each |Δlogp| the prompt's value (signs alternating)."""
    return pd.DataFrame([{"prompt_id": i, "delta_logprob": d * (-1) ** k, "kl": 0.0}
                         for i, d in enumerate(per_prompt) for k in range(5)])


def _floor(name: str, per_prompt: list[float]) -> pd.DataFrame:
    """A floor's per-prompt sums (noise_verdict.FLOOR_PROMPT_COLUMNS), five tokens a prompt."""
    return pd.DataFrame({"floor": name, "prompt_id": range(len(per_prompt)), "n": 5,
                         "sum_abs_dlogp": [5 * f for f in per_prompt]})


def _columns(mismatch: list[float], floor: list[float], name: str = "noise_train_mean_abs_dlogp", **more) -> dict:
    summary = {name: sum(floor) / len(floor), "mean_abs_dlogp": sum(mismatch) / len(mismatch), **more}
    return summary | floor_columns(_tokens(mismatch), summary, 0, _floor(name, floor))


def test_the_interval_resamples_prompts_and_decides_the_verdict():
    """floor_columns: the ratio over the largest floor, its bootstrap interval over prompts (seeded), the verdict.
    The same mean mismatch on prompts that agree is above the floor; spread over prompts that disagree, it is not
    told from it."""
    n = MIN_PROMPTS
    steady = _columns([1.5e-3] * n, [1e-3] * n)
    assert steady[RATIO] == pytest.approx(1.5) and steady[RATIO + "_ci_low"] == pytest.approx(1.5)
    assert steady[VERDICT] == ABOVE and steady[FLOOR_USED] == "noise_train_mean_abs_dlogp"
    spread = [0.1e-3, 0.2e-3, 0.3e-3, 0.4e-3, 3.5e-3, 4.5e-3] * 4  # mean 1.5e-3 too
    row = _columns(spread, [1e-3] * len(spread))
    assert row[RATIO] == pytest.approx(1.5) and row[RATIO + "_ci_low"] < 1 < row[RATIO + "_ci_high"]
    assert row[VERDICT] == CANNOT_TELL and row == _columns(spread, [1e-3] * len(spread))
    assert floor_columns(_tokens(spread), {"mean_abs_dlogp": 1.5e-3}, 0, _floor("x", spread)) == {}  # no floor


def test_the_interval_resamples_the_floor_with_the_mismatch():
    """A steady mismatch over a floor that swings from prompt to prompt: holding the floor at its mean would give an
    interval of width 0 at 1.2x; resampling the floor's prompts too, paired with the mismatch's, the interval holds
    1 and the verdict cannot tell."""
    floor = [0.0, 2e-3] * (MIN_PROMPTS // 2)  # mean 1e-3
    row = _columns([1.2e-3] * MIN_PROMPTS, floor)
    assert row[RATIO] == pytest.approx(1.2)
    assert row[RATIO + "_ci_low"] < 1 < row[RATIO + "_ci_high"] and row[VERDICT] == CANNOT_TELL
    # paired by prompt: a mismatch that rises and falls with the floor is a steady ratio
    paired = _columns([1.5 * f for f in floor], floor)
    assert paired[RATIO + "_ci_low"] == pytest.approx(1.5) and paired[VERDICT] == ABOVE


def test_too_few_prompts_give_no_interval_and_say_how_many_are_needed():
    """One prompt: every draw is that prompt, so a bootstrap interval would have width 0 and read as certainty. Below
    MIN_PROMPTS there is no interval, the verdict says so with the number needed, and the next command asks for it."""
    row = _columns([1.5e-3], [1e-3])
    assert row[RATIO] == pytest.approx(1.5) and math.isnan(row[RATIO + "_ci_low"])
    assert row[VERDICT] == TOO_FEW and row[PROMPTS] == 1
    words = in_words(row)
    assert f"at least {MIN_PROMPTS} prompts" in words and "1 prompts" in words and "above" not in words
    step = after_compare(_compare(taps="none", batch_invariance=True, num_prompts=1), row)
    assert step.argv[step.argv.index("--num-prompts") + 1] == str(MIN_PROMPTS) and "--graft" not in step.argv
    assert manifest_record(row)["noise_verdict"]["ci"] == [None, None]
    assert math.isnan(bootstrap(MIN_PROMPTS - 1, lambda w: {"x": float(w.sum())}, 10, 0)["x"][0])


def test_a_step_after_a_run_on_too_few_prompts_asks_for_as_many_as_an_interval_needs():
    """A floor measured, or an ablation run, on fewer than MIN_PROMPTS prompts gives no interval: the step after a
    run on 2 prompts asks for MIN_PROMPTS, and says why. A run on a file's every prompt has no count to raise."""
    no_floor = after_compare(_compare(taps="none", num_prompts=2), {"mean_abs_dlogp": 1e-3})
    ablated = after_ablate(spec_from_flat("ablate", num_prompts=2), pd.DataFrame())
    for step in (no_floor, ablated):
        assert step.argv[step.argv.index("--num-prompts") + 1] == str(MIN_PROMPTS), step.argv
        assert f"on {MIN_PROMPTS} prompts" in step.why
    assert "--batch-invariance" in no_floor.argv and ["--side", "train"] == ablated.argv[-2:]
    assert "--num-prompts" not in after_compare(_compare(taps="none"), {"mean_abs_dlogp": 1e-3}).argv
    enough = after_compare(_compare(taps="none", num_prompts=30), {"mean_abs_dlogp": 1e-3})
    assert enough.argv[enough.argv.index("--num-prompts") + 1] == "30" and "prompts" not in enough.why


def test_a_verdict_recorded_on_too_few_prompts_is_read_as_too_few():
    """A run folder from before the minimum holds an interval on 4 prompts and `above_floor`: the report reads it as
    a run today would write it, with no interval and the prompts it needs."""
    recorded = {**FLOOR, "mean_abs_dlogp": 3e-3, RATIO: 1.5, RATIO + "_ci_low": 1.23, RATIO + "_ci_high": 1.45,
                VERDICT: ABOVE}
    read = as_read(recorded, 4)
    assert read[VERDICT] == TOO_FEW and math.isnan(read[RATIO + "_ci_low"]) and read[RATIO] == 1.5
    assert "on 4 prompts" in in_words(read) and f"at least {MIN_PROMPTS}" in in_words(read)
    assert as_read(recorded, MIN_PROMPTS) == recorded and as_read(recorded, None) == recorded


def test_the_verdict_names_its_floor_and_whether_it_is_noise_or_a_systematic_swap():
    """The trainer's kernel swap is a systematic difference, not noise: when it is the largest floor the verdict is
    against it and says so, in summary.csv and in words."""
    n = MIN_PROMPTS
    row = _columns([0.5e-3] * n, [1e-3] * n, "noise_train_kernel_mean_abs_dlogp", noise_train_mean_abs_dlogp=1e-4)
    assert row[FLOOR_USED] == "noise_train_kernel_mean_abs_dlogp" and row[FLOOR_KIND] == SYSTEMATIC
    assert row[VERDICT] == WITHIN
    assert in_words(row).startswith("within the systematic floor") and "attention-kernel" in in_words(row)
    noise = _columns([3e-3] * n, [1e-3] * n)
    assert noise[FLOOR_KIND] == NOISE and in_words(noise).startswith("above the noise floor")


def test_an_ablation_says_when_its_floor_moved_between_the_verdicts():
    """Aligning regions can move the floor itself: a flip from above to within the floor is then partly the floor's."""
    name = "noise_train_mean_abs_dlogp"
    shipped = {VERDICT: ABOVE, FLOOR_USED: name, name: 0.0114}
    aligned = {VERDICT: WITHIN, FLOOR_USED: name, name: 0.0153}
    words = floor_moved(shipped, aligned, "rope+swiglu")
    assert "from above_floor as shipped to within_floor with rope+swiglu" in words and "0.0114 to 0.0153" in words
    assert floor_moved(shipped, {**aligned, name: 0.0114}, "rope") is None  # the floor held: the mismatch moved
    assert floor_moved(shipped, {**aligned, VERDICT: ABOVE}, "rope") is None  # no flip


def test_after_ablate_after_score_after_rl():
    both = spec_from_flat("ablate", regions="rope,swiglu")
    step = after_ablate(both, pd.DataFrame())
    assert step.argv[:2] == ["divergence-probe", "ablate"] and ["--side", "train"] == step.argv[2:4]
    train = replace(both, align=replace(both.align, side="train"))
    # rope removes mismatch (its whole interval below 0), swiglu adds some, together they add: only rope is trained
    shares = pd.DataFrame({"region": ["rope", "swiglu", ALL_REGIONS], CHANGE: [-2e-3, 3e-3, 1e-3],
                           EFFECT: [REMOVES, ADDS, ADDS]})
    step = after_ablate(train, shares)
    assert step.argv[:2] == ["divergence-probe", "rl"] and step.argv.count("--setting") == 2
    assert "none" in step.argv and "rope" in step.argv and not any("swiglu" in a for a in step.argv)
    # a negative change whose interval holds 0, or that has no interval, is no finding: nothing to train with
    assert after_ablate(train, shares.assign(**{EFFECT: [NOT_DETECTED, ADDS, ADDS]})) is None
    assert after_ablate(train, shares.assign(**{EFFECT: NO_INTERVAL})) is None
    assert after_ablate(train, shares, get_family("qwen3_moe")).argv == step.argv  # rl runs on MoE (rope exists)

    call, load = ScoreSpec(rollouts="/data/r.jsonl"), LoadSpec(model="M", device="cpu")
    step = after_score(call, load, {})
    assert step.argv[:3] == ["divergence-probe", "score", "/data/r.jsonl"] and "--infer" in step.argv
    step = after_score(replace(call, infer="vllm"), load, {})
    assert step.argv[:2] == ["divergence-probe", "compare"] and {"--batch-invariance", "M"} <= set(step.argv)

    step = after_rl(RLSpec(steps=5))
    assert step.argv.count("--setting") == 2 and ",".join(NUMERIC_REGIONS) in step.argv and "5" in step.argv
    step = after_rl(RLSpec(setting=("none", "rope")))
    assert step.argv[-2:] == ["--seeds", "3"]
    assert after_rl(RLSpec(setting=("none", "rope"), seeds=3)) is None
    # two seeds that did not separate the settings: the seeds rl_summary.csv says a difference that large would need
    runs = pd.DataFrame({"setting": ["none", "none", "rope", "rope"], "seed": [0, 1, 0, 1],
                         "reward_end": [0.45, 0.60, 0.50, 0.70]})
    undecided = with_comparison(runs)
    need = int(undecided[SEEDS_NEEDED].max())
    step = after_rl(RLSpec(setting=("none", "rope"), seeds=2), None, undecided)
    assert need > 2 and step.argv[-2:] == ["--seeds", str(need)] and "did not separate" in step.why
    apart = with_comparison(runs.assign(reward_end=[0.20, 0.21, 0.60, 0.61]))
    assert after_rl(RLSpec(setting=("none", "rope"), seeds=2), None, apart) is None  # they differ: nothing to add


def test_no_step_is_a_command_the_model_refuses():
    """What the suggested command's own pre-load checks would refuse is never suggested: swiglu on a mixture of
    experts (rl's setting, ablate's regions), graft/depth or generate mode at tensor_parallel_size > 1."""
    from divergence_probe.spec import check_family

    moe, dense = get_family("qwen3_moe"), get_family("qwen3")
    step = after_rl(rl_spec(model="M", steps=5), moe)
    assert step is not None and "rope,rmsnorm" in step.argv and not any("swiglu" in a for a in step.argv)
    over = _measured(1.0, frac_tokens_any_flip=0.5)
    step = after_compare(_compare(model="M", taps="none", batch_invariance=True, side="infer", align="rope"), over, moe)
    assert step is None or not any("swiglu" in a for a in step.argv)
    tp = _compare(model="M", taps="none", batch_invariance=True, engine_args='{"tensor_parallel_size": 2}')
    for summary in (_measured(1.0), _measured(1e-4)):
        step = after_compare(tp, summary, dense)
        if step is not None:  # whatever it suggests passes the checks the command runs before loading
            suggested = spec_from_flat(step.argv[1], **_flags(step.argv))
            check_family(suggested, suggested.load, dense)
            assert "--graft" not in step.argv and "generate" not in step.argv


def _flags(argv: list[str]) -> dict:
    """A printed command line's flags as spec_from_flat takes them (enough for the flags next steps print)."""
    flags, i = {}, 2
    while i < len(argv):
        name = argv[i][2:].replace("-", "_")
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            flags[name], i = argv[i + 1], i + 2
        else:
            flags[name], i = True, i + 1
    return flags


@pytest.fixture
def toy_args(toy, qwen3_tiny, prompts_file):
    return ["--model", qwen3_tiny, "--infer", "toy-fused", "--train", "toy", "--prompts", prompts_file]
