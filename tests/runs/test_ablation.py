"""Attribution math (pure) and ablate end to end on the real stacks."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from divergence_probe.numerics.shapley import ADDS, ALL_REGIONS, CHANGE, DISAGREE, EFFECT, MIN_PROMPTS, NO_INTERVAL, \
    NOT_DETECTED, REMOVES, SHARE, attribution_lines, disagree, effect, effect_words
from divergence_probe.numerics.shapley import Combo, attribution, bootstrap_intervals, change_words, shapley, subsets
from divergence_probe.cli import app
from test_compare_cli import assert_nothing_written, assert_one_line_error

REGIONS = ("rope", "swiglu", "rmsnorm")


def test_subsets_enumerate_every_combination_once():
    combos = subsets(REGIONS)
    assert len(combos) == 8 and len(set(combos)) == 8
    assert combos[0] == Combo() and combos[-1] == Combo(REGIONS)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-1, 1), min_size=3, max_size=3), st.lists(st.floats(-1, 1), min_size=8, max_size=8))
def test_shapley_is_efficient_for_any_game(effects, interactions):
    value = {c: sum(effects[i] for i, r in enumerate(REGIONS) if r in c) + (interactions[k] if len(c) > 1 else 0)
             for k, c in enumerate(subsets(REGIONS))}
    value[Combo()] = 0.0
    phi = shapley(value, REGIONS)
    assert sum(phi.values()) == pytest.approx(value[Combo(REGIONS)], abs=1e-12)


def test_attribution_is_exact_on_an_additive_metric():
    base, effect = 10.0, {"rope": 3.0, "swiglu": 0.5, "rmsnorm": 1.5}
    metric = {c: base - sum(effect[r] for r in c) for c in subsets(REGIONS)}
    table = attribution(metric, REGIONS).set_index("region")
    for r, e in effect.items():  # aligning a region removes mismatch: a negative change
        assert table.loc[r, CHANGE] == pytest.approx(-e)
        assert table.loc[r, "main_effect_change"] == pytest.approx(-e)
        assert table.loc[r, "leave_one_out_change"] == pytest.approx(-e)
        assert table.loc[r, SHARE] == pytest.approx(-e / base)
    assert table.loc[ALL_REGIONS, CHANGE] == pytest.approx(-sum(effect.values()))
    assert table.loc[list(REGIONS), SHARE].sum() == pytest.approx(table.loc[ALL_REGIONS, SHARE])


def test_shares_keep_their_sign_when_aligning_everything_makes_it_worse():
    """A region that removes mismatch reads negative and one that adds positive, even when the regions together
    add mismatch (a share of the total change would flip both signs there), and every share is of the shipped
    value, the all-regions row included."""
    base, effect = 1.0, {"rope": -0.25, "swiglu": 0.0, "rmsnorm": 0.33}  # together: +8% of shipped
    metric = {c: base + sum(effect[r] for r in c) for c in subsets(REGIONS)}
    table = attribution(metric, REGIONS).set_index("region")
    assert table.loc["rope", SHARE] == pytest.approx(-0.25) and table.loc["rmsnorm", SHARE] == pytest.approx(0.33)
    assert table.loc[ALL_REGIONS, SHARE] == pytest.approx(0.08)
    assert change_words(table.loc["rope", SHARE]) == "removes 25%"
    assert change_words(table.loc["rmsnorm", SHARE]) == "adds 33%"
    assert change_words(table.loc[ALL_REGIONS, SHARE]) == "adds 8%"


def test_interaction_is_split_evenly():
    # aligning both rope and rmsnorm is needed to remove 2.0; either alone removes nothing
    metric = {c: 5.0 - (2.0 if {"rope", "rmsnorm"} <= c else 0.0) for c in subsets(REGIONS)}
    table = attribution(metric, REGIONS).set_index("region")
    assert table.loc["rope", CHANGE] == pytest.approx(-1.0) and table.loc["rmsnorm", CHANGE] == pytest.approx(-1.0)
    assert table.loc["swiglu", CHANGE] == pytest.approx(0.0)
    assert table.loc["rope", "main_effect_change"] == 0
    assert table.loc["rope", "leave_one_out_change"] == pytest.approx(-2.0)


def test_bootstrap_interval_brackets_the_estimate_and_is_seeded():
    n = MIN_PROMPTS  # fewer get no interval (test_too_few_prompts_give_no_interval...)
    per_prompt = {c: pd.DataFrame({"n": [10] * n, "sum_kl": [4.0 - len(c), 3.0 + 0.3 * len(c), 5.0 - 2 * len(c),
                                                             4.1 - 0.7 * len(c)] * (n // 4),
                                   "sum_abs_dlogp": [1.0] * n, "max_kl": [1.0] * n, "max_abs_dlogp": [1.0] * n})
                  for c in subsets(REGIONS)}
    a = bootstrap_intervals(per_prompt, REGIONS, "mean_kl", 200, seed=1)
    b = bootstrap_intervals(per_prompt, REGIONS, "mean_kl", 200, seed=1)
    assert a == b
    point = attribution({c: (p["sum_kl"].sum() / p["n"].sum()) for c, p in per_prompt.items()}, REGIONS)
    for r, estimate, share in zip(point.region, point[CHANGE], point[SHARE]):
        assert a[r][0] <= estimate <= a[r][1]
        assert a[r + "/share"][0] <= share <= a[r + "/share"][1]
    assert bootstrap_intervals(per_prompt, REGIONS, "mean_kl", 200, seed=2) != a


def test_a_change_whose_interval_holds_0_reads_as_no_detectable_effect():
    """A point share of -6.51% with an interval from -20% to +7% is no evidence that the region removes anything;
    without an interval the words say there is none."""
    assert effect(-0.2, 0.07) == NOT_DETECTED and effect(-0.3, -0.01) == REMOVES and effect(0.01, 0.2) == ADDS
    words = effect_words(-0.0651, -0.2, 0.07)
    assert words.startswith("no detectable effect") and "removes" not in words and "-6.51%" in words
    assert effect_words(-0.0651, -0.3, -0.01) == "removes 6.51%"
    assert effect(float("nan"), float("nan")) == NO_INTERVAL
    assert effect_words(-0.0651, float("nan"), float("nan")) == "removes 6.51% (no interval)"


def _row(region, share, low, high, other):
    return {"region": region, CHANGE: share * 2e-3, SHARE: share, "share_ci_low": low, "share_ci_high": high,
            EFFECT: effect(low, high), "other_metric": "mean_abs_dlogp", "other_metric_share": other,
            DISAGREE: disagree(share, other)}


def test_the_attribution_lines_rank_only_what_is_detectable_and_say_when_the_metrics_disagree():
    rows = [_row("rope", -0.015, -0.05, 0.02, -0.01), _row("rmsnorm", 0.085, 0.02, 0.15, -0.064),
            _row("swiglu", -0.25, -0.4, -0.1, -0.2), _row(ALL_REGIONS, 0.0708, -0.022, 0.234, 0.01)]
    lines = attribution_lines(rows, "mean_kl")
    assert lines[0].startswith("Aligning every region: no detectable effect (point +7.08%")
    assert lines[1] == "Detectable, largest first: swiglu removes 25%; rmsnorm adds 8.5%."
    assert "rope" not in lines[1]
    [flip] = [line for line in lines if "disagree" in line]
    assert flip.startswith("rmsnorm: mean_kl and mean_abs_dlogp disagree in sign (+8.5% vs -6.4%")
    # a shipped metric of 0 (two identical stacks): no share, the change itself is ranked
    zero = [{**_row("rope", float("nan"), float("nan"), float("nan"), float("nan")), CHANGE: 3e-6, EFFECT: ADDS},
            {**_row(ALL_REGIONS, float("nan"), float("nan"), float("nan"), float("nan")), CHANGE: 3e-6}]
    assert attribution_lines(zero, "mean_kl")[:2] == ["Aligning every region: n/a of the shipped mean_kl.",
                                                      "Detectable, largest first: rope adds 3e-06."]
    none = attribution_lines([_row("rope", -0.015, -0.05, 0.02, -0.01), _row(ALL_REGIONS, -0.01, -0.05, 0.03, -0.01)],
                             "mean_kl")
    assert none[1] == "No region has a detectable effect on mean_kl: every interval holds 0."


# ----------------------------------------------------------------------------- end to end

# (region tap, taps that carry all of its inputs); inputs equal on both stacks => output equal when aligned
REGION_RULES = [
    ("q_rope", lambda i: [f"q_norm@{i}"]),  # Qwen3: RoPE's input is the q_norm output
    ("k_rope", lambda i: [f"k_norm@{i}"]),
    ("post_norm", lambda i: [f"attn_out@{i}", f"resid_out@{i - 1}" if i else "embed@-1"]),
    ("input_norm", lambda i: [f"mlp_out@{i - 1}", f"resid_mid@{i - 1}"] if i else ["embed@-1"]),
]


def check_region_taps(layers: pd.DataFrame, n_layers: int) -> int:
    """Assert every region rule whose inputs are bitwise equal; return how many rules applied."""
    equal = {f"{r.tap}@{r.layer}": r.frac_equal == 1.0 for r in layers.itertuples()}
    applied = 0
    for tap, inputs in REGION_RULES:
        for i in range(n_layers):
            needed = inputs(i)
            if f"{tap}@{i}" in equal and all(equal.get(n, False) for n in needed):
                assert equal[f"{tap}@{i}"], f"{tap}@{i} differs although its inputs {needed} are bitwise equal"
                applied += 1
    return applied


def test_all_regions_aligned_makes_region_taps_bitwise_equal_qwen3(vllm_probe, prompts_file):
    run = vllm_probe.ablate(prompts=prompts_file, bootstrap=50)
    everything = run.layers_table[run.layers_table.combo == "rope+swiglu+rmsnorm"]
    assert check_region_taps(everything, vllm_probe.source.num_layers) >= 3
    shipped = run.layers_table[run.layers_table.combo == "none"]
    assert (shipped.frac_equal < 1).any()  # as shipped, the stacks do disagree
    assert len(run.ablation_table) == 8 and set(run.tokens_table.combo) == set(run.ablation_table.combo)


@pytest.mark.slow
def test_aligning_every_region_lowers_the_mismatch_on_the_built_in_model(cli_processes):
    """What the README and docs/example_report claim for the trained built-in model: with RoPE, SwiGLU and
    residual RMSNorm aligned, vLLM and transformers disagree less than as shipped, in mean KL and mean |Δlogp|,
    on every prompt (measured from tokens.csv, not from the attribution built on the same numbers)."""
    run = cli_processes["builtin"]["builtin-ablate"]
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["model"]["spec"] == "builtin:default" and manifest["load"]["infer"] == "vllm"
    tokens = pd.read_csv(run / "tokens.csv")
    per_prompt = tokens.groupby(["combo", "prompt_id"])[["kl"]].mean()
    per_prompt["abs_dlogp"] = tokens.assign(a=tokens.delta_logprob.abs()).groupby(["combo", "prompt_id"]).a.mean()
    shipped, aligned = per_prompt.loc["none"], per_prompt.loc["rope+swiglu+rmsnorm"]
    assert len(shipped) == 2 and (shipped.kl > 0).all()
    assert (aligned.kl < shipped.kl).all() and (aligned.abs_dlogp < shipped.abs_dlogp).all()
    ablation = pd.read_csv(run / "ablation.csv").set_index("combo")
    assert ablation.loc["rope+swiglu+rmsnorm", "mean_kl"] < ablation.loc["none", "mean_kl"]


@pytest.mark.engine  # compiles the tap reduction (torch.compile)
def test_ablate_cli_writes_its_tables(qwen3_tiny, prompts_file, tmp_path):
    out_dir = tmp_path / "ab"
    result = CliRunner().invoke(app, ["ablate", "--model", str(qwen3_tiny), "--prompts", str(prompts_file),
                                      "--infer", "hf", "--regions", "rope,rmsnorm", "--bootstrap", "20",
                                      "--out", str(out_dir)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    ablation = pd.read_csv(out_dir / "ablation.csv")
    assert list(ablation.combo) == ["none", "rope", "rmsnorm", "rope+rmsnorm"]
    assert list(ablation.columns[:3]) == ["combo", "rope", "rmsnorm"]
    attribution_csv = pd.read_csv(out_dir / "attribution.csv")
    assert list(attribution_csv.columns) == ["region", CHANGE, SHARE, "main_effect_change", "leave_one_out_change",
                                             "ci_low", "ci_high", "share_ci_low", "share_ci_high", EFFECT, "other_metric",
                                             "other_metric_share", DISAGREE]
    assert list(attribution_csv.region) == ["rope", "rmsnorm", ALL_REGIONS]
    for name in ("tokens.csv", "layers.csv", "summary.csv"):
        assert pd.read_csv(out_dir / name).columns[0] == "combo"
    assert json.loads((out_dir / "manifest.json").read_text())["ablate"]["combos"] == list(ablation.combo)


def test_ablate_failing_midway_writes_nothing(qwen3_tiny, prompts_file, tmp_path, nan_on_forward):
    """Four combinations of six transformers forwards each (--infer hf: three prompts per side); the fifteenth,
    prompt 2 on the inference side of the third combination, returns NaN logits: two whole combinations were
    run, and nothing may be written."""
    calls = nan_on_forward(15)
    out_dir = tmp_path / "ab"
    result = CliRunner().invoke(app, ["ablate", "--model", str(qwen3_tiny), "--prompts", str(prompts_file),
                                      "--infer", "hf", "--regions", "rope,rmsnorm", "--taps", "none",
                                      "--bootstrap", "20", "--out", str(out_dir)], catch_exceptions=False)
    assert calls["n"] == 18  # the third combination runs to its end; its scores are read as its prompts finish
    assert_nothing_written(out_dir)
    assert_one_line_error(result, "the inference stack produced NaN/Inf logits on prompt 2")


def test_ablate_rejects_bad_options(qwen3_tiny, tmp_path):
    results = [(message, CliRunner().invoke(app, ["ablate", "--model", str(qwen3_tiny), *flags, "--out", str(tmp_path / "x")]))
               for flags, message in [(["--regions", "attention"], "unknown region"), (["--side", "engine"], "--side"),
                                      (["--metric", "p99"], "--metric")]]
    assert [r.exit_code for _, r in results] == [2] * len(results)
    for message, result in results:
        assert_one_line_error(result, message)


@pytest.mark.slow
def test_qwen2_ablation_through_vllm(cli_processes):
    out_dir = cli_processes["a"]["ablate"]
    layers = pd.read_csv(out_dir / "layers.csv")
    manifest = json.loads((out_dir / "manifest.json").read_text())
    assert manifest["model"]["arch"] == "qwen2"
    assert check_region_taps(layers[layers.combo == "rope+swiglu+rmsnorm"], manifest["model"]["num_layers"]) >= 1
