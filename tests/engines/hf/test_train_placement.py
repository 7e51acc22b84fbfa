"""The trainer's placement: --train-device (its own device; the comparison on the engine's) and its memory plan,
planned per device."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

import divergence_probe as dp
from divergence_probe.runs import memory as memory_plan
from divergence_probe.cli import app
from divergence_probe.errors import DeviceMemoryError, ProbeError
from divergence_probe.runs.memory import plan
from divergence_probe.spec import RunSpec, spec_from_flat

from test_memory_plan import inputs, nothing_written, one_line_error

runner = CliRunner()


# ------------------------------------------------------------------------------------------- --train-device
@pytest.mark.parametrize("device, message", [("gpu", "is not a device; use cpu, cuda or cuda:N"),
                                             ("cuda:7", "--train-device cuda:7, but this torch sees")])
def test_a_train_device_that_is_not_there_is_one_line_before_anything_loads(device, message, qwen3_tiny, tmp_path,
                                                                           monkeypatch):
    import divergence_probe.runs.loading as loading
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # a machine with two GPUs, as far as the check sees
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(loading, "resolve_model", lambda spec: pytest.fail("the model was resolved"))
    out_dir = tmp_path / "run"
    result = runner.invoke(app, ["compare", "--model", str(qwen3_tiny), "--device", "cpu", "--train-device", device,
                                 "--out", str(out_dir)], catch_exceptions=False)
    line = one_line_error(result, message)
    if device == "cuda:7":
        assert "2 CUDA device(s) (cuda:0 to cuda:1)" in line
    assert nothing_written(out_dir)


def test_graft_on_a_trainer_of_its_own_device_is_refused(monkeypatch):
    """--graft runs the trainer's ops on the engine's tensors: with the trainer elsewhere it is refused, not moved."""
    import divergence_probe.environment as environment
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.raises(ProbeError, match="--graft/--depth run the trainer's ops on the engine's own tensors"):
        spec_from_flat("compare", device="cuda", train_device="cuda:1", graft=True)
    assert environment.same_device("cuda", "cuda:0")  # the current GPU under its two names: not a device of its own
    spec_from_flat("compare", device="cuda", train_device="cuda:0", graft=True)


def test_a_trainer_on_its_own_device_is_compared_on_the_engines_and_recorded(qwen3_tiny, prompts_file, hf_probe):
    """--device cpu --train-device cpu: the trainer loaded with its own settings (the one CPU), the run the same as
    without the flag, and the manifest records the placement; a manifest without the field reruns as it ran."""
    probe = dp.load(str(qwen3_tiny), infer="hf", dtype="bfloat16", device="cpu", train_device="cpu")
    try:
        run = probe.compare(prompts=str(prompts_file), num_prompts=2, taps="none")
        base = hf_probe.compare(prompts=str(prompts_file), num_prompts=2, taps="none")
        assert probe.train.settings.device == "cpu"
        assert [t.logprob_train for t in run.tokens] == [t.logprob_train for t in base.tokens]
        assert run.summary == base.summary
        assert run.manifest["spec"]["load"]["train_device"] == "cpu"
        assert run.manifest["load"]["train_device"] == "cpu" and run.manifest["stacks"]["train"]["settings"][
            "device"] == "cpu"
        assert "train_device" not in run.manifest["memory_plan"]  # one device: one plan
        recorded = run.manifest["spec"]
        del recorded["load"]["train_device"]
        assert RunSpec.from_dict(recorded).load.train_device is None
    finally:
        probe.close()


# ------------------------------------------------------------------------------------------- the plan per device
def test_the_plan_puts_the_trainer_on_its_own_device_and_the_comparison_on_the_engines():
    """Qwen2.5-7B, trainer on cuda:1: the engine's device no longer holds the trainer's weights, forward or taps, but
    one sequence of the trainer's outputs moved there for the comparison; the trainer's device holds what it runs."""
    shared = plan(inputs())
    apart = plan(inputs(train_device="cuda:1", train_free_bytes=141 * 10**9, train_free_source="test"))
    assert apart.fits and "train_device" in apart.record() and apart.record()["train_device"]["device"] == "cuda:1"
    for term in ("train_weights", "train_taps", "train_forward"):
        assert term not in apart.terms and apart.train_terms[term] > 0
    assert apart.train_terms["train_weights"] == shared.terms["train_weights"]
    assert apart.train_terms["train_taps"] == shared.terms["train_taps"]
    moved = apart.terms["train_outputs_moved"]
    assert moved >= shared.terms["train_taps"] + 3000 * 152064 * 2  # the taps and the [T, V] logits of a sequence
    assert apart.needed < shared.needed - shared.terms["train_weights"] + moved
    # the trainer's stacked copy is made on its device and arrives among the moved taps: the engine's own stays
    assert apart.train_terms["train_stacked_copies"] == apart.terms["reduction_stacked_copies"] == \
        shared.terms["reduction_stacked_copies"] // 2
    assert apart.train_needed == apart.train_phases["train_and_reduce"] < shared.needed
    with_floor = plan(inputs(noise_floor=True, train_device="cuda:1", train_free_bytes=141 * 10**9))
    assert "noise_floor" not in with_floor.phases and "noise_floor" in with_floor.train_phases  # the second trainer


@pytest.mark.parametrize("short", ["engine", "trainer"])
def test_the_refusal_names_the_device_that_does_not_fit(short):
    apart = dict(train_device="cuda:1", train_free_bytes=141 * 10**9, train_free_source="test", taps=frozenset(),
                 batch_tokens_fixed=True)
    full = plan(inputs(**apart))
    tight = full.train_needed - 1 if short == "trainer" else full.needed - 1
    p = plan(inputs(**apart | (dict(train_free_bytes=tight) if short == "trainer" else dict(free_bytes=tight))))
    assert not p.fits and (p.engine_fits if short == "trainer" else p.train_fits)
    with pytest.raises(DeviceMemoryError) as e:
        memory_plan.check(p)
    line = str(e.value)
    assert "\n" not in line
    if short == "trainer":
        assert "of cuda:1 memory (--train-device)" in line and "another --train-device" in line
    else:
        assert "of cuda memory (the engine's device)" in line and "(or --train-device cuda:1)" not in line


def test_a_trainer_apart_on_the_cpu_beside_a_gpu_engine():
    """The CPU trainer beside a GPU engine: its device is the host's RAM (no fragmentation, the CPU allowance)."""
    p = plan(inputs(train_device="cpu", train_free_bytes=1 << 40, train_free_source="test"))
    assert p.fits and p.train_terms["fragmentation_allowance"] == 0
    assert p.train_terms["runtime_allowance"] == memory_plan.CPU_RUNTIME
    assert p.terms["runtime_allowance"] == memory_plan.CUDA_RUNTIME


def test_the_plan_counts_every_cpu_rank_of_a_sharded_trainer_and_rank_zeros_gpu():
    """--train-tp N: each rank loads the whole checkpoint before keeping its slice; on the CPU the N ranks share the
    host (N copies, a process allowance each), on GPUs the planned device is rank 0's (one whole copy while loading)."""
    cpu = dict(device="cpu", kv_cache_bytes_fixed=1 << 30, free_bytes=1 << 40)
    one, two = plan(inputs(**cpu)), plan(inputs(**cpu, train_tp=2))
    assert two.terms["train_weights"] == 2 * one.terms["train_weights"]
    assert two.terms["train_rank_processes"] == 2 * memory_plan.CPU_RUNTIME and "train_rank_processes" not in one.terms
    assert two.needed == one.needed + one.terms["train_weights"] + 2 * memory_plan.CPU_RUNTIME
    gpu_one, gpu_two = plan(inputs()), plan(inputs(train_tp=2))
    assert gpu_two.terms == gpu_one.terms
    apart = plan(inputs(train_tp=2, train_device="cpu", train_free_bytes=1 << 40))  # CPU ranks beside a GPU engine
    assert apart.train_terms["train_weights"] == 2 * gpu_one.terms["train_weights"]
    assert apart.train_terms["train_rank_processes"] == 2 * memory_plan.CPU_RUNTIME


# ------------------------------------------------------------------------------------------- --train-tp
@pytest.mark.parametrize("flat, message", [
    (dict(graft=True), "--graft/--depth run the trainer's single ops in this process, but --train-tp 2 shards"),
    (dict(taps="none", align="rope", side="train"), "regions are patched into the trainer's modules"),
    (dict(taps="none", train_precision="amp"), "--train-precision amp is not built for a sharded trainer"),
    (dict(taps="none", train_state="inherited"), "--train-state inherited reads what vLLM left in this process"),
])
def test_what_a_sharded_trainer_cannot_do_is_one_line_when_the_spec_is_built(flat, message):
    with pytest.raises(ProbeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        spec_from_flat("compare", train_tp=2, **flat)
    spec_from_flat("compare", train_tp=2, taps="all", align="rope", side="infer")  # all: the logits; the engine alone


def test_a_train_tp_that_does_not_divide_the_model_is_refused_before_loading(qwen3_tiny, tmp_path, monkeypatch):
    import divergence_probe.runs.loading as loading

    monkeypatch.setattr(loading, "stack_for", lambda *a: pytest.fail("a trainer was loaded"))
    out_dir = tmp_path / "run"
    result = runner.invoke(app, ["compare", "--model", str(qwen3_tiny), "--device", "cpu", "--train-tp", "3",
                                 "--taps", "none", "--out", str(out_dir)], catch_exceptions=False)
    one_line_error(result, "--train-tp 3 does not divide the model's num_attention_heads (4)")
    assert nothing_written(out_dir)


@pytest.mark.engine  # compiles the tap reduction (torch.compile)
def test_a_trainer_sharded_over_two_gloo_ranks_stands_beside_its_own_floor(qwen3_tiny, prompts_file):
    """--train-tp 2 on the CPU (2 gloo ranks, transformers' TP plan) against an unsharded transformers instance: the
    whole mismatch is what sharding does, so it must equal the trainer's parallelism floor (kernel_noise.csv's
    `train_tp 1 vs 2`), measured on its own path. Its taps come back gathered: every tap before layer 0's o_proj (the
    first row-parallel sum) bitwise equal to the unsharded trainer's, and from there within the bound
    docs/reference/devices.md states; the logprobs differ (the partial sums are rounded to BF16 before they are
    added). A rank that dies is one line."""
    import os
    import signal

    from divergence_probe.errors import StackError

    probe = dp.load(str(qwen3_tiny), infer="hf", dtype="bfloat16", device="cpu", train_tp=2, train_attn="eager")
    try:
        run = probe.compare(prompts=str(prompts_file), taps="all", batch_invariance=True)
        s = run.summary
        assert [r.change for r in run.kernel_noise.itertuples()] == ["train_tp 1 vs 2"]  # eager: no SDPA kernel row
        assert s["noise_train_tensor_parallel_mean_abs_dlogp"] == pytest.approx(s["mean_abs_dlogp"], rel=1e-9)
        assert 0 < s["mean_abs_dlogp"] < 2**-6
        layers = run.layers_table
        assert s["first_inexact"] == "attn_out@0" and len(layers) == 2 + 4 * 17 + 1  # every tap, gathered
        first = layers.index[(layers.tap == "attn_out") & (layers.layer == 0)][0]
        assert (layers.loc[: first - 1, "frac_equal"] == 1).all()  # embed .. layer 0's attention core
        assert (layers.loc[first:, "rel_l2"] > 0).all() and (layers.rel_l2 < 2**-5).all()
        parallel = run.manifest["stacks"]["train"]["settings"]["tensor_parallel"]
        assert parallel["size"] == 2 and parallel["backend"] == "gloo"
        assert run.manifest["spec"]["load"]["train_tp"] == 2
        os.kill(probe.train._procs[1].pid, signal.SIGKILL)
        with pytest.raises(StackError, match=r"trainer rank 1 of 2 exited \(code -9\) during score") as e:
            probe.compare(prompts=str(prompts_file), num_prompts=1, taps="none")
        assert "\n" not in str(e.value)
    finally:
        probe.close()
