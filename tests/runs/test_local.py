"""Grafted comparison (compare --graft, --depth): local error per seam, aligned regions at zero local error, FP32
roundoff, independence from upstream error, and the depth curve's two ends."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

import divergence_probe as dp
from divergence_probe.cli import app
from divergence_probe.runs.graft import REGION_SEAMS, SEAM_FAMILY, seam_inputs
from divergence_probe.models import get_family
from divergence_probe.prompts import load_prompts
from divergence_probe.reports import write_report
from divergence_probe.run_folder import read_run
from divergence_probe.taps import ALL_TAPS, TapKey, expected_taps

pytestmark = pytest.mark.engine  # every test here starts an engine or runs the tool in a child

QWEN2_TAPS, QWEN3_TAPS = get_family("qwen2").layer_taps, get_family("qwen3").layer_taps

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def seams(num_layers: int, layer_taps) -> set[tuple[str, int]]:
    return {(k.name, k.layer) for k in expected_taps(frozenset(SEAM_FAMILY), num_layers, layer_taps)}


def rows(df: pd.DataFrame) -> set[tuple[str, int]]:
    return set(zip(df.tap, df.layer))


@pytest.fixture(scope="module")
def qwen2_hf_probe(qwen2_tiny):
    probe = dp.load(str(qwen2_tiny), infer="hf", dtype="bfloat16", device="cpu")
    yield probe
    probe.close()


@pytest.fixture(scope="module")
def vllm_graft(vllm_probe, prompts_file):
    """One grafted compare with depth on the session's vLLM engine (tiny Qwen3, BF16, as shipped)."""
    return vllm_probe.compare(prompts=str(prompts_file), graft=True, depth=True)


@pytest.fixture(scope="module")
def qwen2_vllm_runs(tmp_path_factory, qwen2_tiny, prompts_file):
    """Qwen2 through vLLM needs engines of its own: BF16 graft+depth and FP32 graft, two processes started together."""
    root = tmp_path_factory.mktemp("graft")
    common = ["compare", "--model", str(qwen2_tiny), "--prompts", str(prompts_file), "--device", "cpu", "--graft"]
    runs = {"bf16": [*common, "--depth", "--out", str(root / "bf16")],
            "fp32": [*common, "--dtype", "float32", "--out", str(root / "fp32")]}
    env = {**os.environ, "PYTHONPATH": REPO, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1"}
    procs = {name: subprocess.Popen([sys.executable, "-m", "divergence_probe", *args], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for name, args in runs.items()}
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, out[-3000:]
    return {name: root / name for name in runs}


# ------------------------------------------------------------------------------------------------ replay itself
@pytest.mark.parametrize("which", ["qwen3", "qwen2"])
def test_replay_on_the_same_stack_is_the_forward_bitwise(which, hf_probe, qwen2_hf_probe, prompts_file):
    """Two transformers instances: a seam's replay on the other instance's inputs is that instance's forward op on
    the same inputs, so every local error and every depth point is exactly zero (a wrong seam input is not)."""
    probe = hf_probe if which == "qwen3" else qwen2_hf_probe
    run = probe.compare(prompts=str(prompts_file), graft=True, depth=True)
    files = run.files()
    local, depth = files["local.csv"], files["depth.csv"]
    n = probe.source.num_layers
    assert rows(local) == seams(n, probe.source.family.layer_taps)
    assert (local.local_frac_equal == 1).all() and (local.local_rel_l2 == 0).all()
    assert list(depth.layer) == list(range(n + 2))
    assert (depth.mean_abs_dlogp == 0).all() and (depth.mean_kl == 0).all()
    assert set(files["local_families.csv"].family) == set(SEAM_FAMILY.values())


def test_local_error_depends_only_on_the_seam_inputs(hf_probe, prompts_file):
    """Upstream error cannot leak into a local error: with every tap but a seam's inputs replaced by NaN, the
    seam's replay is bitwise what it was."""
    [prompt] = load_prompts(prompts_file, hf_probe.tokenizer, num_prompts=1, max_model_len=2048)
    taps: dict[TapKey, torch.Tensor] = {}
    hf_probe.infer.score([prompt], frozenset(ALL_TAPS), lambda pid, key, x: taps.__setitem__(key, x))
    n = hf_probe.source.num_layers
    clean = hf_probe.train.replay(taps)
    for key in expected_taps(frozenset(SEAM_FAMILY), n, QWEN3_TAPS):
        if key.layer not in (1, n):  # layer 1 has every kind of input (a previous layer); n: final norm, logits
            continue
        keep = set(seam_inputs(key, n, QWEN3_TAPS)) | {TapKey.of("embed", -1)}  # embed: shape and dtype of the context
        poisoned = {k: v if k in keep else torch.full_like(v, float("nan")) for k, v in taps.items()}
        if TapKey.of("embed", -1) not in seam_inputs(key, n, QWEN3_TAPS):
            poisoned[TapKey.of("embed", -1)] = torch.full_like(taps[TapKey.of("embed", -1)], float("nan"))
        got = hf_probe.train.replay(poisoned)[key]
        assert torch.equal(got, clean[key]), key.label


# ------------------------------------------------------------------------------------------------ vLLM vs transformers
def test_local_error_for_every_seam_qwen3(vllm_graft, vllm_probe):
    files = vllm_graft.files()
    local = files["local.csv"].set_index(["tap", "layer"])
    n = vllm_probe.source.num_layers
    assert set(local.index) == seams(n, layer_taps=QWEN3_TAPS)
    assert local.local_rel_l2.map(math.isfinite).all()
    layers = vllm_graft.layers_table.set_index(["tap", "layer"])
    assert (local.propagated_rel_l2 == layers.rel_l2.loc[local.index]).all()  # propagated: today's per-tap diff
    assert (local.local_rel_l2 > 0).any()  # the stacks do differ somewhere locally


def test_depth_curve_ends(vllm_graft, vllm_probe):
    """Grafted at the embedding, the training forward is the ungrafted one: the gap is the run's, bitwise. Grafted at
    the final norm's output, only the lm_head is the training stack's: its gap is zero exactly when the lm_head's
    local error is."""
    depth = vllm_graft.files()["depth.csv"]
    summary = vllm_graft.summary
    n = vllm_probe.source.num_layers
    assert depth.mean_abs_dlogp[0] == summary["mean_abs_dlogp"] and depth.mean_kl[0] == summary["mean_kl"]
    assert depth.max_abs_dlogp[0] == summary["max_abs_dlogp"] and depth.n_tokens[0] == summary["n_tokens"]
    logits = vllm_graft.files()["local.csv"].query("tap == 'logits'").iloc[0]
    assert (depth.mean_abs_dlogp[n + 1] == 0) == (logits.local_frac_equal == 1)
    assert depth.graft[n + 1] == f"final_norm@{n}" and depth.graft[n] == f"resid_out@{n - 1}"


@pytest.mark.parametrize("regions", [("rope", "swiglu", "rmsnorm"), ("rmsnorm", "residual")])
def test_aligned_regions_have_zero_local_error(vllm_probe, prompts_file, regions):
    """Aligned on both stacks, a region is the same function on both: from the same inputs, the same bits (with
    residual, the FP32 stream's taps pair and its adds are seams of their own)."""
    run = vllm_probe.compare(prompts=str(prompts_file), num_prompts=2 if "rope" in regions else 1, graft=True,
                             align=regions, side="both")
    local = run.files()["local.csv"]
    aligned_seams = {s for region in regions for s in REGION_SEAMS[region]}
    assert set(local[local.aligned].tap) == aligned_seams
    assert (local[local.aligned].local_frac_equal == 1).all(), local[local.aligned & (local.local_frac_equal < 1)]


def test_ablate_graft_shows_each_combination(vllm_probe, prompts_file):
    """ablate --graft: every combination's local error, the aligned region's seams marked and at zero local error
    in the combinations that align it, and the shipped combination's rows beside them."""
    run = vllm_probe.ablate(prompts=str(prompts_file), num_prompts=1, regions=("rope",), side="both", graft=True,
                            bootstrap=0, taps="none")
    local = run.files()["local.csv"]
    assert list(local.columns[:2]) == ["combo", "layer"] and set(local.combo) == {"none", "rope"}
    assert set(local[local.aligned].tap) == set(REGION_SEAMS["rope"]) and set(local[local.aligned].combo) == {"rope"}
    assert (local[local.aligned].local_frac_equal == 1).all()
    assert len(local[local.combo == "none"]) == len(local[local.combo == "rope"])
    assert set(run.files()["local_families.csv"].combo) == {"none", "rope"}


def test_qwen2_through_vllm_and_fp32_roundoff(qwen2_vllm_runs, qwen2_tiny, tmp_path):
    """Qwen2 (no q/k norm) through the CLI: every seam, the depth curve, a run folder `report` draws and tabulates; an FP32
    run's local errors at FP32 roundoff: below the worst-case bound of one op's rounding error, K·eps for a sum of
    K products (K: the longest reduction in the model), which the BF16 run's local errors exceed."""
    config = json.loads((qwen2_tiny / "config.json").read_text())
    n = config["num_hidden_layers"]
    bf16 = read_run(qwen2_vllm_runs["bf16"])
    local = bf16.table("local.csv")
    assert rows(local) == seams(n, layer_taps=QWEN2_TAPS)
    depth = bf16.table("depth.csv")
    assert len(depth) == n + 2 and depth.mean_abs_dlogp[0] == bf16.table("summary.csv").mean_abs_dlogp[0]
    report = write_report(qwen2_vllm_runs["bf16"], tmp_path / "report", fmt="latex").parent
    assert {"local_vs_propagated.pdf", "depth.pdf"} <= {p.name for p in (report / "figures").iterdir()}
    assert (report / "local_families.tex").exists() and (report / "depth.tex").exists()
    fp32 = read_run(qwen2_vllm_runs["fp32"]).table("local.csv")
    assert rows(fp32) == rows(local)
    longest = max(config["hidden_size"], config["intermediate_size"])  # (the prompts are shorter: attention's sums)
    bound = longest * torch.finfo(torch.float32).eps
    assert (fp32.local_rel_l2 <= bound).all(), fp32[fp32.local_rel_l2 > bound]
    assert (local.local_rel_l2 > bound).any()  # the bound separates the dtypes: BF16 local errors exceed it


# ------------------------------------------------------------------------------------------------ refusals
def test_graft_refused_where_it_cannot_work(toy, qwen3_tiny, prompts_file, tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["compare", "--model", str(qwen3_tiny), "--infer", "toy-fused", "--train", "toy",
                                 "--prompts", str(prompts_file), "--graft", "--out", str(tmp_path / "t")])
    assert result.exit_code == 2 and "use --train hf" in result.output, result.output
    assert not (tmp_path / "t").exists()
    result = runner.invoke(app, ["compare", "--model", str(qwen3_tiny), "--engine", "compiled", "--depth",
                                 "--prompts", str(prompts_file), "--out", str(tmp_path / "c")])
    assert result.exit_code == 2 and "use --engine eager" in result.output, result.output


def test_generate_mode_grafts_every_scored_token(hf_probe, monkeypatch):
    """Sampled sequences: the engine's taps stop one row short of the sequence, and every one of those rows is
    scored; the graft replays and scores exactly those rows (two transformers instances).

    The trainer's forward of a sampled sequence has one row more than the graft can replay (the last sample, which
    the engine never fed), so attention is replayed at length `fed` on rows the trainer computed at `fed + 1`. With
    identical q/k/v rows, layout, mask (causal, none given), scaling and interface, torch's CPU flash attention can
    still round a few rows differently when only the length changes (data-dependent: AVX-512/AMX hosts, e.g. layer
    0 of this tiny model at 69 vs 68 rows). That is the trainer's kernel, not the graft: measured here on the very
    calls of the run (each full-length causal call redone on its prefix), and exactness is expected wherever the
    kernel is length-invariant; every other seam, and attention wherever it is invariant, must be exact."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = hf_probe.train.model.config._attn_implementation
    inner = ALL_ATTENTION_FUNCTIONS[impl]
    calls: list[tuple[int, int, bool]] = []  # (layer, length, rows 0..length-2 bitwise the same at length - 1)

    def measured(module, query, key, value, attention_mask, **kwargs):
        result = inner(module, query, key, value, attention_mask, **kwargs)
        n = query.shape[2]
        if n > 1 and key.shape[2] == n:
            mask = None if attention_mask is None else attention_mask[..., : n - 1, : n - 1]
            prefix = inner(module, query[:, :, : n - 1], key[:, :, : n - 1], value[:, :, : n - 1], mask, **kwargs)
            calls.append((module.layer_idx, n, torch.equal(result[0][:, : n - 1], prefix[0])))
        return result

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, impl, measured)
    run = hf_probe.compare(num_prompts=2, graft=True, depth=True,
                           generate=dict(max_new_tokens=5, samples_per_prompt=2, temperature=0.8))
    files = run.files()
    tokens = run.tokens_table
    lengths = set(tokens.groupby(["prompt_id", "sample_id"]).size() + 1)  # the scoring forwards: fed + 1 rows
    full = [(layer, ok) for layer, n, ok in calls if n in lengths]
    num_layers = len(hf_probe.train.layers)
    assert len(full) >= 2 * len(lengths) * num_layers  # both stacks' scoring forwards, every layer, were measured
    variant = {layer for layer, ok in full if not ok}  # layers whose kernel changes rows when the length drops by 1

    local = files["local.csv"]
    inexact = set(zip(local.tap[local.local_frac_equal < 1], local.layer[local.local_frac_equal < 1]))
    assert inexact == {("attn_core", layer) for layer in variant}
    depth = files["depth.csv"]
    assert (depth.n_tokens == len(tokens)).all()
    exact_from = max(variant, default=-1) + 1  # from here on every replayed layer is length-invariant
    assert (depth[depth.layer >= exact_from].mean_abs_dlogp == 0).all()
