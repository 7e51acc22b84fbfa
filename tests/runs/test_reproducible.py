"""Runs reproduce byte for byte across fresh processes: the CSV files, the tap sums, the manifest."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.engine  # every test here starts an engine or runs the tool in a child


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["prefill", "generate"])
def test_fresh_processes_write_the_same_bytes(cli_processes, mode):
    """Two processes, each with its own engine, write byte-identical files; the manifests differ in the command
    line's --out only."""
    a, b = cli_processes["a"][mode], cli_processes["b"][mode]
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    assert {"tokens.csv", "layers.csv", "summary.csv", "prompts.jsonl"} <= set(files)
    assert ("buckets.csv" in files) == (mode == "generate")
    for name in files:
        if name != "manifest.json":
            assert (a / name).read_bytes() == (b / name).read_bytes(), name
    manifest_a, manifest_b = (json.loads((d / "manifest.json").read_text()) for d in (a, b))
    command_a, command_b = manifest_a.pop("command"), manifest_b.pop("command")
    assert command_a[-2:] == ["--out", str(a)] and command_b[-2:] == ["--out", str(b)]
    assert command_a[:-1] == command_b[:-1]
    for manifest in (manifest_a, manifest_b):  # the free memory each process found, an input of its memory plan
        manifest["memory_plan"].pop("free")
        manifest.pop("phases")  # the seconds each phase took: a measurement of this process, not an output
        manifest["placement"].pop("why")  # names the free memory the placement was chosen against
    assert manifest_a == manifest_b
    assert manifest_a["load"]["infer"] == "vllm" and manifest_a["compare"]["mode"] == mode


@pytest.mark.slow
def test_tap_sums_are_the_same_bytes_in_fresh_processes(cli_processes):
    """The per-tap sums come from the compiled reduction, compiled anew in one process (an empty cache) and found
    in the user's cache or compiled there in the other; layers.csv holds them at full precision (shortest
    round-trip repr), so equal bytes mean equal sums."""
    a, b = cli_processes["a"]["prefill"], cli_processes["b"]["prefill"]
    for run in (a, b):
        reduction = json.loads((run / "manifest.json").read_text())["compare"]["tap_reduction"]
        assert reduction.startswith("torch.compile"), reduction
    layers = (a / "layers.csv").read_bytes()
    assert layers == (b / "layers.csv").read_bytes()
    assert len(layers.splitlines()) > 40  # every tap of every layer, not an empty table
