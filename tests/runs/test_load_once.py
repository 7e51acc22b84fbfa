"""The load reads top to bottom (runs/loading.py prepare): the model resolved, the run checked against its family,
the prompts read and tokenized, the plan made, both stacks built. Each once: a compare or an ablation through the
CLI reads and tokenizes its prompts once, checks the model's family against the run once, and has validated its
LoadSpec once when the first stack loads."""

from __future__ import annotations

from collections import Counter

import pytest
from typer.testing import CliRunner

from divergence_probe.cli import app


@pytest.fixture
def counted(toy, monkeypatch) -> Counter:
    """Counts of what the load does more than once if it can: `tokenize` (a prompt file read and tokenized),
    `family` (the run checked against the model's family), `loadspec` (LoadSpec validated), and `loadspec at load`
    (those made when the first stack was built). The tap reduction runs eagerly: nothing here is about it."""
    from divergence_probe.numerics import fused
    from divergence_probe.runs import loading, probe
    from divergence_probe.spec.load import LoadSpec

    monkeypatch.setattr(fused, "_backend", "eager (the load's test)")
    monkeypatch.setattr(fused, "_compiled", None)
    counts = Counter()

    def counting(module, name: str, key: str) -> None:
        original = getattr(module, name)

        def counted_call(*args, **kwargs):
            counts[key] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted_call)

    counting(loading, "load_prompts", "tokenize")
    counting(loading, "check_family", "family")
    counting(probe, "check_family", "family")
    validate = LoadSpec.__post_init__

    def counted_validate(self):
        counts["loadspec"] += 1
        validate(self)

    monkeypatch.setattr(LoadSpec, "__post_init__", counted_validate)
    build = loading.stack_for

    def first_build(name, settings):
        counts.setdefault("loadspec at load", counts["loadspec"])
        return build(name, settings)

    monkeypatch.setattr(loading, "stack_for", first_build)
    return counts


@pytest.mark.parametrize("command", [["compare"], ["ablate", "--regions", "toy-align", "--side", "train",
                                                   "--bootstrap", "20"]], ids=["compare", "ablate"])
def test_a_run_tokenizes_its_prompts_and_checks_its_family_once(counted, command, qwen3_tiny, prompts_file, tmp_path):
    result = CliRunner().invoke(app, [*command, "--model", str(qwen3_tiny), "--infer", "toy-fused", "--train", "toy",
                                      "--prompts", str(prompts_file), "--device", "cpu", "--out", str(tmp_path / "run")])
    assert result.exit_code == 0, result.output
    assert counted["tokenize"] == 1 and counted["family"] == 1, counted
    assert counted["loadspec at load"] == 1, counted
