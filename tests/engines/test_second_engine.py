"""A second engine is one folder: tests/engines/second_engine/ (a dense decoder in plain torch behind the engine
protocol), registered through `engines.register_stack` and nothing else, runs compare with every tap and the
batch-invariance floor and ablate with a region aligned in it, end to end through the CLI in this process, and refuses
in one line, before anything loads, what it declares it cannot do."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

import second_engine
from divergence_probe.cli import app
from divergence_probe.engines import INFER_STACKS, STACKS, TRAIN_STACKS
from divergence_probe.engines.protocol import Stack, StackClass
from divergence_probe.models import get_family
from second_engine.stack import NO_GRAFT, SAMPLES_NOTHING, SecondStack
from test_conformance import mismatches

PACKAGE = Path(__file__).resolve().parents[2] / "divergence_probe"


@pytest.fixture(scope="module")
def second(qwen3_tiny, prompts_file):
    """The engine registered for this module, and the flags its runs share. The tap reduction runs eagerly here: its
    compiled path is the tool's own, tested where it is built, and compiling it would cost more than these runs."""
    remove = second_engine.register()
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("DIVERGENCE_PROBE_EAGER", "1")
            yield ["--model", str(qwen3_tiny), "--infer", second_engine.NAME, "--prompts", str(prompts_file)]
    finally:
        remove()
    assert second_engine.NAME not in STACKS and second_engine.NAME not in INFER_STACKS


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args], terminal_width=400)


def test_the_engine_conforms_and_the_package_never_names_it(second):
    assert mismatches(SecondStack, StackClass) == []
    assert mismatches(SecondStack, Stack, SecondStack()) == []
    assert second_engine.NAME in INFER_STACKS and second_engine.NAME not in TRAIN_STACKS
    named = [path.name for path in PACKAGE.rglob("*.py") if "second_engine" in path.read_text()]
    assert named == []


def test_compare_captures_every_dense_tap_and_measures_the_batch_floor(second, qwen3_tiny, tmp_path):
    out = tmp_path / "compare"
    result = cli("compare", *second, "--batch-invariance", "--out", out)
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["stacks"]["infer"]["name"] == second_engine.NAME and manifest["stacks"]["train"]["name"] == "hf"
    layers = pd.read_csv(out / "layers.csv")
    config = json.loads((qwen3_tiny / "config.json").read_text())
    every = {(tap, layer) for layer in range(config["num_hidden_layers"])
             for tap in get_family(config["model_type"]).layer_taps}
    assert every <= set(zip(layers.tap, layers.layer))  # the engine handed over each layer's every tap
    summary = pd.read_csv(out / "summary.csv").iloc[0]
    assert summary.mean_abs_dlogp > 0  # two implementations of one model round differently
    assert summary.noise_infer_mean_abs_dlogp >= 0 and summary.noise_train_mean_abs_dlogp >= 0  # beside its floors
    batched = pd.read_csv(out / "batch_invariance.csv")
    assert second_engine.NAME in set(batched["stack"])  # the engine alone vs batched as it batches


def test_ablate_aligns_a_region_in_the_engine(second, tmp_path):
    """--side infer: only the engine is patched, so a combination that differs from the shipped one shows the
    engine took the region (its patches, named by its class)."""
    out = tmp_path / "ablate"
    result = cli("ablate", *second, "--regions", "swiglu", "--side", "infer", "--taps", "none", "--out", out)
    assert result.exit_code == 0, result.output
    ablation = pd.read_csv(out / "ablation.csv").set_index("combo")
    assert set(ablation.index) == {"none", "swiglu"}
    assert ablation.loc["swiglu", "mean_kl"] != ablation.loc["none", "mean_kl"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["stacks"]["infer"]["implementations"]["swiglu"].endswith("silu_times")  # what it ships


@pytest.mark.parametrize("flags, line", [(["--mode", "generate"], SAMPLES_NOTHING), (["--graft"], NO_GRAFT)])
def test_what_the_engine_declares_it_cannot_do_is_one_line_before_it_loads(second, flags, line, tmp_path,
                                                                          monkeypatch):
    monkeypatch.setattr(SecondStack, "load", lambda self, settings: pytest.fail("the engine loaded"))
    out = tmp_path / "refused"
    result = cli("compare", *second, *flags, "--out", out)
    assert result.exit_code == 2 and result.output.strip() == f"error: {line}"
    assert not out.exists()


@pytest.mark.parametrize("command, flags", [("compare", ["--align", "rope", "--side", "infer"]),
                                            ("ablate", ["--regions", "rope,swiglu", "--side", "both"])])
def test_a_region_the_engine_does_not_align_is_one_line_before_anything_loads(second, command, flags, tmp_path,
                                                                               monkeypatch):
    """The engine declares the regions it aligns (SecondStack.aligns: swiglu); a run asking it for another is refused
    by the spec, before the model is resolved or either stack loads, not by the engine's patches once loaded."""
    from divergence_probe.engines.hf.trainer import HFStack
    from divergence_probe.runs import loading

    monkeypatch.setattr(loading, "resolve_model", lambda *a, **k: pytest.fail("the model was resolved"))
    monkeypatch.setattr(SecondStack, "load", lambda self, settings: pytest.fail("the engine loaded"))
    monkeypatch.setattr(HFStack, "load", lambda self, settings: pytest.fail("the trainer loaded"))
    out = tmp_path / "refused"
    result = cli(command, *second, *flags, "--taps", "none", "--out", out)
    flag = "--regions" if command == "ablate" else "--align"
    assert result.exit_code == 2 and result.output.strip() == (
        "error: rope cannot be aligned on the second engine (--infer second), which aligns swiglu; leave it out of "
        f"{flag}, or align on the other stack alone (--side train)")
    assert not out.exists()


def test_a_model_the_engine_cannot_run_is_one_line_before_anything_loads(second, qwen3_moe_tiny, tmp_path,
                                                                          monkeypatch):
    from divergence_probe.engines.hf.trainer import HFStack

    monkeypatch.setattr(HFStack, "load", lambda self, settings: pytest.fail("the trainer loaded"))
    flags = [qwen3_moe_tiny if flag == second[1] else flag for flag in second]
    result = cli("compare", *flags, "--taps", "none", "--out", tmp_path / "moe")
    assert result.exit_code == 2 and "runs dense models" in result.output and len(result.output.splitlines()) == 1
    assert not (tmp_path / "moe").exists()


@pytest.mark.parametrize("side, stack, line", [
    ("both", "vllm", "rope cannot be aligned on the second engine (rl's rollout engine), which aligns swiglu; leave it "
                     "out of --setting, or align on the other stack alone (--side train)"),
    ("train", "hf", "rope cannot be aligned on the second engine (rl's trainer), which aligns swiglu; leave it out of "
                    "--setting"),  # rl has no --side infer to offer
])
def test_rl_refuses_a_setting_its_stacks_do_not_align_before_anything_loads(second, side, stack, line, tmp_path,
                                                                             monkeypatch):
    """rl's engine (or trainer) resolved to the engine, which declares swiglu alone: a setting aligning rope there is
    refused by rl's spec in compare's words, naming the setting, before the model is resolved or a stack loads."""
    from divergence_probe.engines.hf.trainer import HFStack
    from divergence_probe.rl import experiment
    from divergence_probe.runs import loading

    monkeypatch.setitem(STACKS, stack, STACKS[second_engine.NAME])
    monkeypatch.setattr(experiment, "load", lambda *a, **k: pytest.fail("rl loaded its stacks"))
    monkeypatch.setattr(loading, "resolve_model", lambda *a, **k: pytest.fail("the model was resolved"))
    monkeypatch.setattr(SecondStack, "load", lambda self, settings: pytest.fail("the engine loaded"))
    monkeypatch.setattr(HFStack, "load", lambda self, settings: pytest.fail("the trainer loaded"))
    out = tmp_path / "refused"
    result = cli("rl", "--model", second[1], "--device", "cpu", "--side", side, "--setting", "none",
                 "--setting", "swiglu,rope", "--out", out)
    assert result.exit_code == 2 and result.output.strip() == f"error: --setting 'rope,swiglu': {line}"
    assert not out.exists()


def test_remedies_lists_the_arms_the_engine_cannot_align_as_not_run_and_runs_the_rest(second, tmp_path):
    """The engine aligns swiglu alone: the arms aligning more on it are not run, with compare's line (without its fix:
    remedies has no flag naming regions), and the run goes on with the rest."""
    arms = "aligned_both,aligned_trainer,lm_head"
    out = tmp_path / "remedies"
    result = cli("remedies", *second, "--num-prompts", 2, "--arms", arms, "--cost-repeats", 1, "--bootstrap", 0,
                 "--out", out)
    assert result.exit_code == 0, result.output
    table = pd.read_csv(out / "remedies.csv").set_index("arm")
    assert list(table.index) == arms.split(",")
    reasons = {"aligned_both": "rope, rmsnorm cannot be aligned on the second engine (--infer second), which aligns "
                               "swiglu",
               "lm_head": "lm_head cannot be aligned on the second engine (--infer second), which aligns swiglu"}
    assert table.loc[list(reasons), "status"].eq("not_run").all()
    assert table.loc[list(reasons), "reason"].to_dict() == reasons
    assert table.drop(list(reasons))["status"].eq("run").all()
    assert json.loads((out / "manifest.json").read_text())["remedies"]["not_run"] == reasons


def test_remedies_none_of_whose_arms_the_engine_can_run_is_one_line_before_loading(second, tmp_path, monkeypatch):
    """With no arm it can run asked, the run is refused with each arm's reason, before either stack loads."""
    from divergence_probe.engines.hf.trainer import HFStack

    monkeypatch.setattr(SecondStack, "load", lambda self, settings: pytest.fail("the engine loaded"))
    monkeypatch.setattr(HFStack, "load", lambda self, settings: pytest.fail("the trainer loaded"))
    out = tmp_path / "remedies"
    result = cli("remedies", *second, "--num-prompts", 2, "--arms", "aligned_both,lm_head", "--out", out)
    assert result.exit_code == 2 and result.output.strip() == (
        "error: no chosen arm can run: aligned_both: rope, rmsnorm cannot be aligned on the second engine (--infer "
        "second), which aligns swiglu | lm_head: lm_head cannot be aligned on the second engine (--infer second), which "
        "aligns swiglu; choose arms this model and these stacks can run with --arms, or omit --arms to try every "
        "arm")
    assert not out.exists()
