"""diff RUN_A RUN_B on two toy runs that differ by one aligned region: what moved is named (summary, layers,
tokens, the manifest's region setting); runs of other prompts or another model are refused in one line."""

from __future__ import annotations

import json
import shutil

import pandas as pd
import pytest
from typer.testing import CliRunner

from divergence_probe.cli import app


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args], terminal_width=400)


@pytest.fixture
def two_runs(toy, qwen3_tiny, prompts_file, tmp_path_factory):
    """The toy stacks as shipped (A) and with toy-align in the trainer (B): B's trainer rounds as the engine does."""
    base = tmp_path_factory.mktemp("diff")
    args = ["--model", qwen3_tiny, "--infer", "toy-fused", "--train", "toy", "--prompts", prompts_file, "--taps", "resid_out"]
    for name, extra in (("a", []), ("b", ["--align", "toy-align", "--side", "train"])):
        result = invoke("compare", *args, *extra, "--out", base / name)
        assert result.exit_code == 0, result.output
    return base / "a", base / "b"


def test_diff_names_what_moved(two_runs, tmp_path):
    a, b = two_runs
    result = invoke("diff", a, b, "--out", tmp_path / "d")
    assert result.exit_code == 0, result.output
    summary = pd.read_csv(tmp_path / "d" / "diff_summary.csv").set_index("metric")
    sa, sb = (pd.read_csv(r / "summary.csv").iloc[0] for r in (a, b))
    assert float(summary.loc["mean_abs_dlogp", "a"]) == sa.mean_abs_dlogp > 0
    assert float(summary.loc["mean_abs_dlogp", "b"]) == sb.mean_abs_dlogp == 0
    assert summary.loc["first_inexact", "a"] == sa.first_inexact and summary.loc["first_inexact", "b"] == "none"
    layers = pd.read_csv(tmp_path / "d" / "diff_layers.csv")
    la = pd.read_csv(a / "layers.csv")
    assert len(layers) == len(la) and not layers.grew.any()  # aligning removed error, it grew nowhere
    tokens = pd.read_csv(tmp_path / "d" / "diff_tokens.csv")
    ta = pd.read_csv(a / "tokens.csv")
    assert len(tokens) == len(ta)
    assert tokens.moved.iloc[0] == -ta.delta_logprob.abs().max()  # most moved first
    manifest = pd.read_csv(tmp_path / "d" / "diff_manifest.csv", keep_default_na=False).set_index("key")
    assert json.loads(manifest.loc["spec.align.regions", "b"]) == ["toy-align"]
    assert "command" not in manifest.index and not any(k.startswith("files.") for k in manifest.index)
    assert "spec.align.regions" in (tmp_path / "d" / "diff.md").read_text()


@pytest.mark.parametrize("section, key, value, says", [
    ("compare", "prompt_files_sha256", {"prompts.txt": "0" * 64}, "different prompts"),
    ("model", "config_sha256", "f" * 64, "different models"),
])
def test_diff_refuses_other_inputs(two_runs, tmp_path, section, key, value, says):
    a, b = two_runs
    other = tmp_path / "other"
    shutil.copytree(b, other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest[section][key] = value
    (other / "manifest.json").write_text(json.dumps(manifest))
    result = invoke("diff", a, other, "--out", tmp_path / "d")
    assert result.exit_code == 2 and says in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "d").exists()
