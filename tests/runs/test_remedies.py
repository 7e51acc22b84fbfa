"""remedies: each arm changes what it claims to, costs are measured (an arm slowed on purpose ranks costlier), and
only arms whose interval is clear of zero are ranked. One remedies run on the two-transformers probe serves the
module: no engine starts."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch

from divergence_probe.engines.hf.patches import layers as fp32_layers
from divergence_probe.engines import peak
from divergence_probe.engines.hooks import HookSet
from divergence_probe.numerics.remedies import NO_INTERVAL_WHY, NOT_RUN, RAN, ranked, ranking_lines
from divergence_probe.numerics.shapley import ADDS, NOT_DETECTED, REMOVES, SHIPPED
from divergence_probe.runs import remedies, remedy_cost
from divergence_probe.spec.remedies import ARM_NAMES
from divergence_probe.spec.run import spec_from_flat

ARMS = "aligned_trainer,fp32_layers,fp32_last_layers,fp16,train_kernels_liger,routing_ids,correction"
SLOW = 0.1  # seconds each aligned RMSNorm call sleeps while costs are timed: far above the machine's own spread
HELD = 64 << 20  # bytes the FP16 arm's engine step holds on top of its work: far above the resident set's wander


@pytest.fixture(scope="module")
def run(hf_probe, prompts_file, tmp_path_factory, request):
    """Every arm the dense tiny model runs on two prompts, with the aligned RMSNorm slowed while the trainer's forward is
    timed (aligned_trainer calls it in every layer, fp32_layers in one) and the FP16 arm's engine step made to hold
    more memory."""
    import divergence_probe.engines.hf.patches.rmsnorm as patched_norm

    shipped_normalize = patched_norm.normalize

    def slow_normalize(*args):
        time.sleep(SLOW)
        return shipped_normalize(*args)

    def slowed(step):
        def timed(view, prompts):
            patched_norm.normalize = slow_normalize
            try:
                step(view, prompts)
            finally:
                patched_norm.normalize = shipped_normalize
        return timed

    reads = []  # the resident sets read so far, by the sampler and at a block's ends
    shipped_resident = peak.resident

    def counted(pid=None):
        reads.append(shipped_resident(pid))
        return reads[-1]

    def heavier(step):
        def timed(view, prompts):
            held = torch.ones(HELD // 4) if view.settings.dtype == torch.float16 else None  # the FP16 arm's engine
            if held is not None:  # held until the sampler has read the resident set once with it: a loaded machine
                seen = len(reads)  # can keep the sampling thread off a core for longer than any fixed sleep
                deadline = time.monotonic() + 30
                while len(reads) == seen and time.monotonic() < deadline:
                    time.sleep(0.001)
            step(view, prompts)
            del held
        return timed

    steps = {side: slowed(step) if side == "train_forward" else heavier(step) if side == "engine_step" else step
             for side, step in remedy_cost.STEPS.items()}
    spec = spec_from_flat("remedies", load=hf_probe.config, prompts=str(prompts_file), num_prompts=2, arms=ARMS,
                          fp32_layers=1, cost_repeats=2)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(peak, "resident", counted)
        return remedies.run_remedies(hf_probe, spec, steps=steps)


def _row(run, arm: str) -> pd.Series:
    return run.table.set_index("arm").loc[arm]


def test_every_chosen_arm_is_listed_and_those_the_platform_cannot_run_say_why(run):
    table = run.table
    assert list(table["arm"]) == ARMS.split(",")
    assert set(table[table["status"] == RAN]["arm"]) == {"aligned_trainer", "fp32_layers", "fp32_last_layers", "fp16"}
    assert "cuda only" in _row(run, "train_kernels_liger")["reason"]  # Liger on the CPU
    assert "dense" in _row(run, "routing_ids")["reason"] and "rl --setting" in _row(run, "correction")["reason"]
    lines = ranking_lines(table, "mean_abs_dlogp")
    assert sum(line.startswith("not run: ") for line in lines) == 3


def test_costs_are_measured_an_arm_slowed_on_purpose_costs_more_and_ranks_costlier(run):
    slow, quick = _row(run, "aligned_trainer"), _row(run, "fp32_layers")
    # 4 layers' 4 norms and the final norm against one layer's 4: 13 more sleeps per forward; half of them is far
    # above what a loaded machine moves a median of two by
    assert slow["train_forward_added_s"] - quick["train_forward_added_s"] > 6 * SLOW
    for side in remedy_cost.SIDES:  # every side is timed, each with its spread
        assert slow[f"{side}_spread_s"] >= 0 and np.isfinite(slow[f"{side}_s"]) and np.isfinite(quick[f"{side}_s"])
    # with both taken as removing the same mismatch, the ranking by cost follows the measured seconds: the forward's,
    # since on a shared machine the backward's and the engine's own spread can exceed the slowdown
    both = run.table.assign(effect=[REMOVES if a in ("aligned_trainer", "fp32_layers") else e
                                    for a, e in zip(run.table["arm"], run.table["effect"])],
                            step_added_s=run.table["train_forward_added_s"])
    ranks = ranked(both).set_index("arm")["cost_rank"]
    assert ranks["fp32_layers"] == 1 and ranks["aligned_trainer"] == 2


def test_the_engine_steps_peak_memory_is_read_an_arm_holding_more_there_is_seen_larger(run):
    table = run.table.set_index("arm")
    peaks = table.loc[table["status"] == RAN, "engine_step_peak_added_bytes"]
    assert peaks.notna().all()
    others = peaks.drop("fp16")
    assert peaks["fp16"] - others.max() > HELD / 2  # the sampled resident set of the process running the engine


def test_a_workers_resident_set_is_read_in_its_own_process():
    """An engine in a worker process holds its memory there: its resident set is sampled from this one."""
    import subprocess
    import sys

    from divergence_probe.engines.peak import PeakMemory

    # the child says when it holds the bytes and keeps them until told to go: no race with a loaded machine
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.readline(); "
                              f"held = b\"1\" * {HELD}; print('held', flush=True); sys.stdin.readline()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        with PeakMemory("cpu", pid=child.pid).measuring() as meter:
            child.stdin.write(b"go\n")
            child.stdin.flush()
            assert child.stdout.readline() == b"held\n"
        mine = PeakMemory("cpu")
        with mine.measuring():
            time.sleep(0.05)
    finally:
        child.stdin.write(b"done\n")
        child.stdin.flush()
        child.wait()
    assert meter.peak > HELD / 2 and mine.peak < HELD / 2


def test_a_kernel_set_without_a_backward_is_never_stepped_backward_and_ranks_as_scoring_side(hf_probe, run):
    """The engine's kernels in the trainer carry no gradients (their kernel set declares no backward): a backward
    through them raises nothing, it stops at the first such op, so its time and memory are no training step's. The
    side is not run, says why, and the arm is a scoring-side remedy ranked on the sides it has."""
    from dataclasses import replace

    called = []
    steps = {side: lambda view, prompts, side=side: called.append(side) for side in remedy_cost.STEPS}
    step = remedies.ARMS["train_kernels_vllm"].step(spec_from_flat("compare", load=hf_probe.config, taps="none"), None)
    cost = remedy_cost.measure_cost(replace(hf_probe, config=step.load), run.prompts, 1, steps)
    assert called == ["train_forward", "train_forward", "engine_step", "engine_step"]  # a warm-up and one repeat each
    assert np.isnan(cost["train_forward_backward_s"]) and np.isnan(cost["train_forward_backward_peak_bytes"])
    assert cost["train_forward_backward_note"] == ("--train-kernels vllm: its ops carry no gradients: rl refuses "
                                                   "this set")
    shipped = remedy_cost.measure_cost(hf_probe, run.prompts, 1, steps)
    assert "train_forward_backward_note" not in shipped and called[4:] == [s for s in remedy_cost.STEPS for _ in "12"]

    def compared(scale):
        tokens = pd.DataFrame({"prompt_id": np.arange(20), "delta_logprob": scale * np.linspace(1, 2, 20), "kl": 0.0})
        return SimpleNamespace(tokens_table=tokens, summary={})

    table = remedies.remedies_table({SHIPPED: compared(1.0), "train_kernels_vllm": compared(0.5)},
                                    {"train_kernels_vllm": cost}, shipped, {}, ("train_kernels_vllm",),
                                    spec_from_flat("remedies").remedies, 0)
    row = table.iloc[0]
    assert row["needs"] == "trainer only, scoring side: cannot train" and row["cost_rank"] == 1
    assert row["step_added_s"] == row["train_forward_added_s"] + row["engine_step_added_s"]
    assert ranking_lines(table, "mean_abs_dlogp")[0].startswith(
        "1. train_kernels_vllm (trainer only, scoring side: cannot train)")


def test_an_arm_that_runs_out_of_memory_is_not_run_with_why_and_other_failures_are_raised():
    from divergence_probe.errors import StackError

    why = remedies._arm_failed(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "cuda")
    assert why.startswith("out of cuda memory while the arm ran (OutOfMemoryError: CUDA out of memory") and \
        "--batch-tokens" in why
    assert remedies._arm_failed(StackError("the seam moved"), "cuda") == "the seam moved"
    with pytest.raises(KeyError):
        remedies._arm_failed(KeyError("a bug"), "cuda")


def test_the_fp16_engine_is_given_the_shipped_engines_planned_kv_budget_and_share(hf_probe):
    """On a GPU a second engine starts only with its KV cache sized and its share of the device given: the memory
    plan's, as the shipped engine got them (the worker refuses to start without a share)."""
    from dataclasses import replace

    from divergence_probe.engines.protocol import freeze_engine_args

    planned = {"kv_cache_memory_bytes": 123_456_789, "gpu_memory_utilization": 0.07}
    probe = replace(hf_probe, settings=replace(hf_probe.settings, engine_args=freeze_engine_args(planned)))
    step = remedies.ARMS["fp16"].step(spec_from_flat("compare", load=hf_probe.config, taps="none"), None)
    settings = remedies._fp16_engine_settings(probe, step)
    assert settings.dtype == torch.float16 and settings.engine_kwargs() == planned


def test_fp16_arm_runs_both_stacks_in_fp16_against_its_own_floors(hf_probe, run):
    step = remedies.ARMS["fp16"].step(spec_from_flat("compare", load=hf_probe.config, taps="none"), None)
    seen = {}
    with remedies._arm_view(hf_probe, step, ()) as view:
        for side in ("infer", "train"):
            stack = getattr(view, side)
            assert {p.dtype for p in stack.model.parameters()} == {torch.float16}
            hook = stack.model.model.layers[0].register_forward_hook(
                lambda m, a, out, side=side: seen.update({side: (out[0] if isinstance(out, tuple) else out).dtype}))
            stack.score(run.prompts[:1], frozenset(), lambda *_: None)
            hook.remove()
    assert seen == {"infer": torch.float16, "train": torch.float16}
    assert {p.dtype for p in hf_probe.train.model.parameters()} == {torch.bfloat16}  # the shipped stacks untouched
    fp16 = run.runs["fp16"].summary
    assert run.manifest["remedies"]["arms"]["fp16"]["load"]["dtype"] == "float16"
    assert _row(run, "fp16")["floor_mean_abs_dlogp"] == max(fp16[k] for k in ("noise_infer_mean_abs_dlogp",
                                                                             "noise_train_mean_abs_dlogp",
                                                                             "noise_train_kernel_mean_abs_dlogp"))


def test_fp32_layers_changes_exactly_those_layers_norms_rope_and_swiglu(hf_probe, run):
    model = hf_probe.train.model
    layers = model.model.layers
    replacements = fp32_layers.patch(model, [1])
    modules = {id(r.target) for r in replacements if isinstance(r.target, torch.nn.Module)}
    layer = layers[1]
    expected = {id(m) for m in (layer, layer.input_layernorm, layer.post_attention_layernorm, layer.self_attn.q_norm,
                                layer.self_attn.k_norm, layer.mlp, layer.self_attn)}
    assert modules == expected  # no other layer's module, no final norm, no rotary module
    assert {r.name for r in replacements if not isinstance(r.target, torch.nn.Module)} == {"apply_rotary_pos_emb"}

    ids = torch.tensor([run.prompts[0].token_ids])
    positions = torch.arange(ids.shape[1])[None]

    def outputs() -> list[torch.Tensor]:
        got = []
        hooks = [m.register_forward_hook(lambda mod, a, out: got.append(out[0] if isinstance(out, tuple) else out))
                 for m in layers]
        with torch.inference_mode():
            model(input_ids=ids, position_ids=positions)
        for h in hooks:
            h.remove()
        return got

    shipped = outputs()
    with HookSet() as hooks:
        hooks.apply(replacements)
        aligned = outputs()
    assert torch.equal(shipped[0], aligned[0])  # before the chosen layer: bitwise as shipped
    assert not torch.equal(shipped[1], aligned[1])
    assert torch.equal(outputs()[1], shipped[1])  # undone on exit
    recorded = run.manifest["remedies"]["arms"]["fp32_layers"]
    assert len(recorded["layers"]) == 1 and "rise of resid_out" in recorded["layer_choice"]
    assert recorded["align"]["regions"] == ["rope", "swiglu", "rmsnorm"] and recorded["align"]["side"] == "train"


def test_fp32_last_layers_changes_exactly_the_last_k_layers_and_is_paired_with_fp32_layers(hf_probe, run):
    recorded = run.manifest["remedies"]
    last = hf_probe.source.num_layers - 1
    assert recorded["arms"]["fp32_last_layers"]["layers"] == [last] == recorded["fp32_last_layers"]["layers"]
    assert recorded["arms"]["fp32_last_layers"]["layer_choice"] == "the last 1"
    assert recorded["fp32_layers"]["layers"] != [last]  # else the arm would not have run (below)
    model = hf_probe.train.model
    ids = torch.tensor([run.prompts[0].token_ids])

    def outputs() -> list[torch.Tensor]:
        got = []
        hooks = [m.register_forward_hook(lambda mod, a, out: got.append(out[0] if isinstance(out, tuple) else out))
                 for m in model.model.layers]
        with torch.inference_mode():
            model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None])
        for h in hooks:
            h.remove()
        return got

    shipped = outputs()
    step = remedies.ARMS["fp32_last_layers"].step(spec_from_flat("compare", load=hf_probe.config, taps="none"),
                                                  hf_probe.source.family)
    with remedies._arm_view(hf_probe, step, (last,)):
        arm = outputs()
    assert all(torch.equal(a, b) for a, b in zip(shipped[:last], arm[:last])) and not torch.equal(shipped[-1], arm[-1])
    row, other = _row(run, "fp32_last_layers"), _row(run, "fp32_layers")
    assert row["paired_with"] == "fp32_layers" and row["paired_change"] == pytest.approx(row["value"] - other["value"])


def test_last_layers_that_are_the_divergent_ones_are_not_run_and_say_why():
    table = pd.DataFrame({"layer": [0, 1, 2, 3], "tap": "resid_out", "rel_l2": [0.01, 0.05, 0.10, 0.30]})
    last = remedies.ARMS["fp32_last_layers"]
    for k, divergent in ((2, (2, 3)), (3, (1, 2, 3)), (5, (0, 1, 2, 3))):  # rises 0.01, 0.04, 0.05, 0.20
        choices = {name: arm.layers(table, k, 4) for name, arm in remedies.ARMS.items() if arm.layers}
        assert choices["fp32_layers"][0] == choices["fp32_last_layers"][0] == divergent
        with pytest.raises(remedies.NotRun, match="are those fp32_layers chose .the .* with the largest rise"):
            remedies.arm_layers(last, choices)
    rising_early = table.assign(rel_l2=[0.5, 1.0, 1.25, 1.5])
    choices = {name: arm.layers(rising_early, 2, 4) for name, arm in remedies.ARMS.items() if arm.layers}
    assert choices["fp32_layers"][0] == (0, 1)
    assert remedies.arm_layers(last, choices) == (2, 3) and remedies.arm_layers(remedies.ARMS["fp16"], choices) == ()


def test_layers_are_chosen_by_the_rise_of_the_shipped_runs_divergence():
    layers = pd.DataFrame({"layer": [0, 1, 2, 3], "tap": "resid_out", "rel_l2": [0.01, 0.02, 0.10, 0.11]})
    assert remedies.divergent_layers(layers, 2, 4)[0] == (0, 2)  # rises 0.01, 0.01, 0.08, 0.01: ties go earlier
    first, why = remedies.divergent_layers(layers.iloc[:0], 3, 4)
    assert first == (0, 1, 2) and "first 3" in why


def _synthetic(effects: dict[str, tuple[float, float, float]]) -> pd.DataFrame:
    rows = [{"arm": arm, "status": RAN, "reason": "", "needs": "both", "claim": "c", "change": change,
             "change_ci_low": low, "change_ci_high": high, "share": change, "share_ci_low": low,
             "share_ci_high": high, "effect": remedies.effect(low, high), "mismatch_over_floor": 1.0,
             "step_added_s": 0.1 * i} for i, (arm, (change, low, high)) in enumerate(effects.items())]
    return ranked(pd.DataFrame(rows + [{"arm": "off", "status": NOT_RUN, "reason": "why"}]))


def test_ranking_ignores_arms_whose_interval_straddles_zero():
    table = _synthetic({"big_but_unsure": (-0.9, -1.5, 0.1), "small": (-0.1, -0.2, -0.05), "large": (-0.5, -0.6, -0.4),
                        "worse": (0.3, 0.2, 0.4)}).set_index("arm")
    assert table.loc["big_but_unsure", "effect"] == NOT_DETECTED and table.loc["worse", "effect"] == ADDS
    assert table["effect_rank"].dropna().to_dict() == {"large": 1, "small": 2}
    assert table["cost_rank"].dropna().to_dict() == {"small": 1, "large": 2}  # small adds less time here
    lines = ranking_lines(table.reset_index(), "mean_abs_dlogp")
    assert lines[0].startswith("1. large") and "no detectable effect: big_but_unsure" in lines
    assert not any(line.startswith(("3.", "4.")) for line in lines)


def test_arms_that_all_failed_once_loaded_are_said_not_to_have_run_not_to_remove_nothing():
    """Arms planned but all failing on the loaded stacks (out of memory, a stack refusing one) leave no arm that ran:
    the conclusion says so, where "no arm removes" would read as arms measured and found wanting."""
    table = ranked(pd.DataFrame([{"arm": "fp16", "status": NOT_RUN, "reason": "out of cpu memory while the arm ran"}]))
    lines = ranking_lines(table, "mean_abs_dlogp")
    assert lines == ["No arm ran, so none is ranked.", "not run: fp16: out of cpu memory while the arm ran"]


@pytest.mark.parametrize(("arm", "other", "scale", "effect"), [
    ("routing_ids_weights", "routing_ids", 0.55, REMOVES),  # ids+weights removes more than ids alone
    ("fp32_last_layers", "fp32_layers", 0.65, ADDS),  # the divergent layers remove more than the last ones
])
def test_paired_arms_are_compared_on_the_same_prompt_draws(arm, other, scale, effect):
    """One arm of a pair removes a little more than the other on every prompt: paired, that difference is detectable
    even where each arm's own interval against shipped is wide."""
    rng = np.random.default_rng(0)
    base = rng.uniform(0.5, 5.0, 40)  # prompts of very different mismatch: unpaired intervals are wide

    def run_of(scale):
        tokens = pd.DataFrame({"prompt_id": np.arange(40), "delta_logprob": base * scale, "kl": base * scale})
        return SimpleNamespace(tokens_table=tokens, summary={})

    runs = {SHIPPED: run_of(1.0), other: run_of(0.6), arm: run_of(scale)}
    cost = {f"{side}_{k}": 0.0 for side in remedy_cost.SIDES for k in ("s", "spread_s", "peak_bytes")} | {
        "train_weights_bytes": 0.0, "engine_step_timed_in": "process", "trains": True}
    options = spec_from_flat("remedies").remedies
    unrun = next(a for a in ("fp32_last_layers", "routing_ids_weights") if a != arm)  # the other pair's, not run
    chosen = tuple(a for a in remedies.ARMS if a in runs or a == unrun)
    table = remedies.remedies_table(runs, {a: cost for a in runs}, cost, {unrun: "why"}, chosen, options, 0
                                    ).set_index("arm")
    row = table.loc[arm]
    assert row["paired_with"] == other and row["paired_change"] == pytest.approx((scale - 0.6) * base.mean())
    assert row["paired_effect"] == effect and (row["paired_ci_high"] < 0 if effect == REMOVES else
                                               row["paired_ci_low"] > 0)
    assert pd.isna(table.loc[other].get("paired_with"))  # the pair is one row's: the other arm's is its own
    # a paired arm not run names its pair beside its reason, and has no difference
    assert table.loc[unrun, "status"] == NOT_RUN and table.loc[unrun, "paired_with"] == remedies.ARMS[unrun].paired_with
    assert pd.isna(table.loc[unrun, "paired_change"])


def test_the_run_folder_and_its_report_section(run, tmp_path):
    from divergence_probe.reports import write_report
    from divergence_probe.run_folder import read_run

    folder = tmp_path / "remedies"
    run.write(folder)
    read = read_run(folder)
    assert list(read.tables["remedies.csv"]["arm"]) == ARMS.split(",")
    assert set(read.tables["tokens.csv"]["combo"]) == {SHIPPED, "aligned_trainer", "fp32_layers", "fp32_last_layers",
                                                       "fp16"}
    report = write_report(folder).read_text()
    assert "What to change: remedies ranked" in report and "not run: correction" in report
    paired = next(line for line in report.splitlines() if line.startswith("- `fp32_last_layers` against `fp32_layers`"))
    assert paired.endswith(NO_INTERVAL_WHY) and "`mean_abs_dlogp` " in paired  # two prompts: no bootstrap interval
    printed = next(line for line in run.lines() if line.startswith("fp32_last_layers against fp32_layers: "))
    assert printed == paired.removeprefix("- ").replace("`", "")  # the command prints the report's words, plain


def _remedies_folder(path, pair: dict | None, level: float = 0.9):
    """A remedies run folder written by hand: fp32_layers and its paired fp32_last_layers, whose row holds `pair`'s
    columns (status, reason and the paired_* ones; None: a folder from before the pairs, no paired column at all)."""
    from test_report import _layers, _manifest, _summary, _tokens, _write

    rng = np.random.default_rng(4)
    tokens = _tokens(rng, 0.01)
    summary = pd.DataFrame([{"combo": combo, **_summary(tokens, "q_rope@0")}
                            for combo in (SHIPPED, "fp32_layers", "fp32_last_layers")])
    ran = {"status": RAN, "reason": "", "needs": "trainer only", "metric": "mean_abs_dlogp", "shipped": 0.02,
           "mismatch_over_floor": 1.1, "floor": "the engine's own batch change", "step_added_s": 0.01}
    rows = [{"arm": "fp32_layers", "claim": remedies.ARMS["fp32_layers"].claim, **ran, "change": -0.004,
             "change_ci_low": -0.005, "change_ci_high": -0.003, "share": -0.2, "share_ci_low": -0.25,
             "share_ci_high": -0.15, "effect": REMOVES},
            {"arm": "fp32_last_layers", "claim": remedies.ARMS["fp32_last_layers"].claim, **ran, "change": -0.001,
             "change_ci_low": -0.003, "change_ci_high": 0.001, "share": -0.05, "share_ci_low": -0.15,
             "share_ci_high": 0.05, "effect": NOT_DETECTED, **(pair or {})}]
    manifest = _manifest(kind="remedies", remedies={"metric": "mean_abs_dlogp", "bootstrap": 1000, "ci_level": level})
    return _write(path, manifest, {"layers": _layers(rng, 0.01), "summary": summary,
                                   "remedies": ranked(pd.DataFrame(rows))}, tokens.assign(combo=SHIPPED))


def _remedies_report(tmp_path, pair: dict | None, fmt: str = "md") -> str:
    from divergence_probe.reports import write_report

    return write_report(_remedies_folder(tmp_path / "run", pair), fmt=fmt).read_text()


@pytest.mark.parametrize("fmt", ["md", "html", "latex"])
def test_a_paired_difference_clear_of_zero_is_stated_with_its_interval_and_verdict(fmt, tmp_path):
    report = _remedies_report(tmp_path, {"paired_with": "fp32_layers", "paired_change": 0.003,
                                         "paired_ci_low": 0.0021, "paired_ci_high": 0.0042, "paired_effect": ADDS}, fmt)
    code = {"md": "`{}`", "html": "<code>{}</code>", "latex": "\\texttt{{{}}}"}[fmt]
    arm, pair = code.format("fp32\\_last\\_layers" if fmt == "latex" else "fp32_last_layers"), \
        code.format("fp32\\_layers" if fmt == "latex" else "fp32_layers")
    assert "Paired comparisons" in report
    percent = "\\%" if fmt == "latex" else "%"
    assert f"{arm} against {pair}: " in report and f"+0.003 (90{percent} interval +0.0021 to +0.0042): " in report
    assert f"{arm} leaves more mismatch than {pair}" in report and "no detectable difference" not in report


def test_a_paired_difference_whose_interval_holds_zero_is_no_detectable_difference(tmp_path):
    report = _remedies_report(tmp_path, {"paired_with": "fp32_layers", "paired_change": -3.4e-05,
                                         "paired_ci_low": -0.000147, "paired_ci_high": 8.7e-05,
                                         "paired_effect": NOT_DETECTED})
    line = next(line for line in report.splitlines() if line.startswith("- `fp32_last_layers` against"))
    assert "`mean_abs_dlogp` -3.4e-05 (90% interval -0.000147 to +8.7e-05): no detectable difference" in line
    assert "leaves" not in line


def test_a_paired_arm_not_run_gives_its_reason_in_place_of_the_comparison(tmp_path):
    why = "its layers (3) are those fp32_layers chose (the 1 with the largest rise): the same arm"
    report = _remedies_report(tmp_path, {"status": NOT_RUN, "reason": why, "paired_with": "fp32_layers",
                                         "paired_change": float("nan"), "paired_ci_low": float("nan"),
                                         "paired_ci_high": float("nan"), "paired_effect": float("nan")})
    assert f"- `fp32_last_layers` against `fp32_layers`: not run: {why}" in report
    assert "interval" not in report.split("Paired comparisons")[1].split("**Table")[0]


def test_a_folder_from_before_the_paired_columns_renders_without_a_paired_line(tmp_path):
    report = _remedies_report(tmp_path, None)
    assert "What to change: remedies ranked" in report and "- 1. fp32_layers" in report and "(cost rank 1)" in report
    assert "Paired comparisons" not in report and " against `fp32_layers`" not in report


def test_a_remedies_spec_is_checked_before_loading_and_read_back_as_recorded():
    from divergence_probe.errors import ProbeError
    from divergence_probe.spec import RunSpec

    spec = spec_from_flat("remedies", arms="fp16,aligned_both", fp32_layers=3)
    assert spec.remedies.arms == ("aligned_both", "fp16")  # ARMS order
    assert RunSpec.from_dict(spec.to_dict()) == spec  # what rerun runs
    with pytest.raises(ProbeError, match="not an arm"):
        spec_from_flat("remedies", arms="fp8")
    with pytest.raises(ProbeError, match="--placement together"):
        spec_from_flat("remedies", placement="alternate")
    assert spec_from_flat("remedies", engine="compiled").capture.taps == "none"  # no residual stream to read


@pytest.mark.parametrize("arms, needles", [
    ("", ["names no arm", "omit --arms to try every arm"]),
    (",", ["names no arm", "omit --arms to try every arm"]),
    ("fp16,,lm_head", ["--arms 'fp16,,lm_head' has an empty item", "omit --arms to try every arm"]),
    ("fp16,", ["--arms 'fp16,' has an empty item"]),
    ("fp16,fp16", ["--arms names fp16 twice", "name each arm once"]),
    ("fp16, lm_head ,fp16", ["--arms names fp16 twice"]),
])
def test_an_arms_list_naming_no_arm_an_empty_item_or_an_arm_twice_is_one_line_before_loading(arms, needles, tmp_path,
                                                                                              monkeypatch):
    """Read leniently, an empty list ran every arm, a stray comma or a repeat ran other arms than the line seems to
    name: each is refused before anything loads, nothing written."""
    from typer.testing import CliRunner

    from divergence_probe.cli import app

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["remedies", "--device", "cpu", "-n", "2", "--arms", arms])
    assert result.exit_code == 2, result.output
    lines = result.output.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert all(needle in lines[0] for needle in needles), lines[0]
    assert not list(tmp_path.iterdir())


def test_arms_omitted_are_every_arm_and_spaces_around_a_name_are_read_as_the_name():
    """What the command passes for an omitted --arms, and the empty list a manifest records for it, are every arm."""
    from typer.testing import CliRunner

    from divergence_probe.cli import app
    from divergence_probe.spec import RunSpec

    result = CliRunner().invoke(app, ["remedies", "--device", "cpu", "--bootstrap", "-1"])
    assert result.exit_code == 2 and "--bootstrap -1" in result.output and "--arms" not in result.output
    assert spec_from_flat("remedies").remedies.chosen == ARM_NAMES
    assert spec_from_flat("remedies", arms=" fp16 , lm_head").remedies.arms == ("lm_head", "fp16")
    recorded = spec_from_flat("remedies").to_dict()
    assert not recorded["remedies"]["arms"]
    assert RunSpec.from_dict(recorded).remedies.chosen == ARM_NAMES


@pytest.mark.parametrize("flags, reasons", [
    (["--arms", "routing_ids"], ["routing_ids: qwen3 is a dense model: no router to replay"]),
    (["--arms", "routing_ids,correction"], ["routing_ids: qwen3 is a dense model", "correction: TIS/MIS reweight"]),
    (["--train-tp", "2", "--arms", "aligned_both"], ["aligned_both: regions are patched into the trainer's modules"]),
])
def test_arms_none_of_which_can_run_are_one_line_with_each_reason_before_loading(flags, reasons, tmp_path,
                                                                                  monkeypatch):
    """Loading both stacks and running the shipped compare to rank no arm would end in a conclusion about arms that
    never ran: refused once the model's family is known, before anything loads, nothing written."""
    from typer.testing import CliRunner

    from divergence_probe.cli import app

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["remedies", "--device", "cpu", "-n", "2", *flags])
    assert result.exit_code == 2, result.output
    lines = result.output.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no chosen arm can run"), result.output
    assert all(reason in lines[0] for reason in reasons) and "omit --arms" in lines[0], lines[0]
    assert not list(tmp_path.iterdir())


def test_a_loaded_probe_asked_for_arms_none_of_which_can_run_refuses_before_the_shipped_compare(hf_probe,
                                                                                                prompts_file):
    from divergence_probe.errors import ProbeError

    spec = spec_from_flat("remedies", load=hf_probe.config, prompts=str(prompts_file), num_prompts=1,
                          arms="routing_ids")
    with pytest.raises(ProbeError, match="no chosen arm can run: routing_ids: qwen3 is a dense model"):
        remedies.run_remedies(hf_probe, spec, steps={})  # no step: the shipped compare would time none


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_fp8_off_with_no_fp8_says_why_and_names_the_gpu_only_off_one(device):
    spec = spec_from_flat("remedies", device=device)
    with pytest.raises(remedies.NotRun) as why:
        remedies._fp8_off(spec, None)
    assert "nothing to turn off" in str(why.value)
    assert ("needs a GPU" in str(why.value)) == (device == "cpu")


def test_arms_aligning_regions_a_stack_does_not_align_are_planned_not_run_with_no_stack_loaded(toy):
    """The toy stacks align toy-align alone: every arm aligning the numeric regions, on the trainer (fp32_layers and
    fp32_last_layers patch its layers) or on both, is not run, with why, decided from the spec and the model's family."""
    from dataclasses import replace

    from divergence_probe.models import get_family

    spec = spec_from_flat("remedies", infer="toy-fused", train="toy", arms="aligned_both,aligned_trainer,lm_head,"
                          "fp32_layers,fp32_last_layers,fp16")
    planned, reasons = remedies.plan_arms(spec, get_family("qwen3"))
    numeric = "rope, swiglu, rmsnorm cannot be aligned on toy (--train toy), which aligns toy-align"
    assert reasons == {"aligned_both": "rope, swiglu, rmsnorm cannot be aligned on toy-fused (--infer toy-fused), "
                                       "which aligns toy-align",
                       "aligned_trainer": numeric,
                       "lm_head": "lm_head cannot be aligned on toy-fused (--infer toy-fused), which aligns toy-align",
                       "fp32_layers": numeric, "fp32_last_layers": numeric}
    assert list(planned) == ["fp16"]  # the arm that aligns no region


def test_last_layers_run_alone_whatever_the_divergent_arm_would_choose(hf_probe, prompts_file):
    """fp32_last_layers is not run as a repeat of fp32_layers only where fp32_layers runs: chosen alone, with every
    layer in FP32 (the divergent arm would choose the same), it runs."""
    every = hf_probe.source.num_layers
    spec = spec_from_flat("remedies", load=hf_probe.config, prompts=str(prompts_file), num_prompts=1,
                          arms="fp32_last_layers", fp32_layers=every, cost_repeats=1, bootstrap=0)
    run = remedies.run_remedies(hf_probe, spec)
    row = _row(run, "fp32_last_layers")
    assert row["status"] == RAN, row["reason"]
    assert run.manifest["remedies"]["arms"]["fp32_last_layers"]["layers"] == list(range(every))
