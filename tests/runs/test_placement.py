"""--placement alternate writes the files a run with both stacks together writes, byte for byte: the engine runs every
prompt first (in a worker process, which exits), its outputs kept on the host or in chunk files, then the trainer runs
against them through the same pairing and reduction.

The together runs are the suite's own: the CLI processes' Qwen2 compare, generate-mode compare and ablation
(conftest.cli_processes), the in-process tiny Qwen3 engine (conftest.vllm_probe) and transformers pair
(conftest.hf_probe). Each alternate run here is in this process, its engine in a worker of its own.
"""

from __future__ import annotations

import pytest
import torch

import divergence_probe as dp
from divergence_probe.runs import memory as memory_plan
from divergence_probe.spec import spec_from_flat

pytestmark = pytest.mark.engine  # every test starts an engine (a worker) or compiles the reduction

FILES = ("tokens.csv", "layers.csv", "summary.csv", "routing.csv", "attribution.csv")


def assert_same_files(together, alternate) -> None:
    compared = 0
    for name in FILES:
        if (together / name).exists():
            assert (alternate / name).read_bytes() == (together / name).read_bytes(), name
            compared += 1
    assert compared >= 3


def alternate_run(kind: str, out, **flags):
    spec = spec_from_flat(kind, placement="alternate", **flags)
    run = dp.run(spec, spill_near=out)
    run.write(out)
    return run


@pytest.mark.parametrize("mode", ["prefill", "generate", "ablate"])
def test_qwen2_alternate_writes_the_together_files(mode, cli_processes, qwen2_tiny, prompts_file, tmp_path):
    """The CLI's Qwen2 runs with both stacks together (conftest.cli_processes: its flags, here as options)."""
    model = {"model": str(qwen2_tiny), "prompts": str(prompts_file), "device": "cpu"}
    options = {"prefill": {"taps": "all"},
               "generate": {"num_prompts": 2, "taps": "none", "mode": "generate", "max_new_tokens": 8,
                            "samples_per_prompt": 2, "temperature": 0.7, "top_p": 0.9},
               "ablate": {"num_prompts": 1, "bootstrap": 50}}[mode]
    run = alternate_run("ablate" if mode == "ablate" else "compare", tmp_path / "out", **model, **options)
    assert_same_files(cli_processes["a"][mode], tmp_path / "out")
    placement = run.manifest["placement"]
    assert placement["placement"] == "alternate" and placement["engine_starts"] == 1
    assert placement["kept_outputs"]["kept"] == "host"
    if mode == "ablate":  # every combination aligns regions in the engine: one pass each, on one eager engine
        assert placement["engine_passes"] == len(run.runs)


def test_qwen3_alternate_with_the_noise_floor_and_the_reference(vllm_probe, prompts_file, tmp_path, monkeypatch):
    """The in-process engine (conftest.vllm_probe) beside the trainer, against a worker engine and then the trainer
    alone; --batch-invariance's engine calls (each sequence alone, batched) come from the kept outputs too. The
    float64 reference loads in the trainer's pass, once the engine's worker has exited (the memory plan counts it
    beside the trainer alone), and measures both stacks as it does beside both."""
    from divergence_probe.engines.hf.trainer import HFStack
    from divergence_probe.runs import alternate

    together = vllm_probe.compare(prompts=str(prompts_file), taps="all", batch_invariance=True, reference="float64")
    together.write(tmp_path / "together")
    events = []
    load, passes = HFStack.load, alternate._engine_passes

    def logged_load(self, settings):
        events.append(settings.dtype)
        return load(self, settings)

    def logged_passes(*args, **kwargs):
        done = passes(*args, **kwargs)
        events.append("engines closed")
        return done

    monkeypatch.setattr(HFStack, "load", logged_load)
    monkeypatch.setattr(alternate, "_engine_passes", logged_passes)
    run = alternate_run("compare", tmp_path / "alternate", model=vllm_probe.config.model, dtype="bfloat16",
                        device="cpu", prompts=str(prompts_file), taps="all", batch_invariance=True,
                        reference="float64")
    assert_same_files(tmp_path / "together", tmp_path / "alternate")
    for name in ("batch_invariance.csv", "kernel_noise.csv"):
        assert (tmp_path / "alternate" / name).read_bytes() == (tmp_path / "together" / name).read_bytes(), name
    assert events.index("engines closed") < events.index(torch.float64)
    assert run.manifest["memory_plan"]["inputs"]["reference"] == "float64"


def test_spilled_outputs_read_back_and_removed(hf_probe, prompts_file, tmp_path, monkeypatch):
    """A host budget below the kept outputs: they go to chunk files beside the run folder, are read back from there
    (the same files as together), and are removed at the end; --keep-engine-outputs keeps them."""
    together = hf_probe.compare(prompts=str(prompts_file), taps="all")
    together.write(tmp_path / "together")
    monkeypatch.setenv(memory_plan.HOST_ENV, "1")
    flags = dict(model=hf_probe.config.model, infer="hf", dtype="bfloat16", device="cpu", prompts=str(prompts_file),
                 taps="all")
    run = alternate_run("compare", tmp_path / "spilled", **flags)
    assert_same_files(tmp_path / "together", tmp_path / "spilled")
    kept = run.manifest["placement"]["kept_outputs"]
    assert kept["kept"] == "file" and kept["chunks"] > 0 and kept["folder"] is None
    assert not [p for p in tmp_path.iterdir() if ".engine-outputs-" in p.name]  # nothing left beside --out
    run = alternate_run("compare", tmp_path / "kept", keep_engine_outputs=True, **flags)
    folder = run.manifest["placement"]["kept_outputs"]["folder"]
    assert folder and len(list((tmp_path / folder).rglob("chunk-*.pt"))) == run.manifest["placement"]["kept_outputs"][
        "chunks"]
