"""--train-kernels: the trainer's kernel sets, their refusals before anything loads, and the engine's own kernels in
the trainer making the first norm bitwise equal across the stacks."""

from __future__ import annotations

from importlib.util import find_spec

import pytest
from typer.testing import CliRunner

from divergence_probe.cli import app
from divergence_probe.engines.hf.kernels import KERNELS, get_kernels
from divergence_probe.errors import ProbeError
from divergence_probe.spec import AlignSpec, LoadSpec, RunSpec
from test_compare_cli import assert_nothing_written, assert_one_line_error


def test_every_registered_kernel_set_is_found_by_its_name():
    assert list(KERNELS) == ["torch", "vllm", "liger"]
    for name in KERNELS:
        assert get_kernels(name).name == name
    with pytest.raises(ProbeError, match="choose one of: torch, vllm, liger"):
        get_kernels("triton")


def test_liger_on_a_cpu_is_one_line_before_anything_loads(tmp_path):
    out_dir = tmp_path / "run"
    result = CliRunner().invoke(app, ["compare", "--train-kernels", "liger", "--device", "cpu", "--out", str(out_dir)])
    assert_one_line_error(result, "--train-kernels liger runs on cuda only", "the trainer is on cpu")
    assert_nothing_written(out_dir)


@pytest.mark.skipif(find_spec("liger_kernel") is not None, reason="liger-kernel is installed here")
def test_liger_without_its_package_says_how_to_install_it():
    with pytest.raises(ProbeError, match="pip install liger-kernel"):
        get_kernels("liger").check("cuda")


def test_a_region_that_patches_an_op_of_the_kernel_set_is_refused_naming_both():
    with pytest.raises(ProbeError, match="region rmsnorm and --train-kernels vllm both replace"):
        RunSpec(load=LoadSpec(train_kernels="vllm", device="cpu"), align=AlignSpec(regions=("rmsnorm",)))
    # on the engine alone, or a region the set does not touch, the two compose
    RunSpec(load=LoadSpec(train_kernels="vllm", device="cpu"), align=AlignSpec(regions=("rmsnorm",), side="infer"))
    RunSpec(load=LoadSpec(train_kernels="vllm", device="cpu"), align=AlignSpec(regions=("lm_head",)))


def test_rl_refuses_a_kernel_set_without_a_backward(tmp_path):
    result = CliRunner().invoke(app, ["rl", "--train-kernels", "vllm", "--out", str(tmp_path / "rl")])
    assert_one_line_error(result, "--train-kernels vllm runs ops without a backward")


@pytest.mark.engine  # the trainer's tap reduction compiles
def test_the_engine_kernels_in_the_trainer_are_undone_when_it_closes(qwen3_tiny, prompts_file):
    """No engine: both sides transformers, the trainer on vLLM's kernels. Its scores move off the zero baseline, and
    closing the probe leaves transformers' modeling code as it was."""
    import divergence_probe as dp

    from transformers.models.qwen3 import modeling_qwen3 as modeling

    shipped = modeling.apply_rotary_pos_emb
    probe = dp.load(str(qwen3_tiny), infer="hf", train_kernels="vllm", dtype="bfloat16", device="cpu")
    try:
        assert modeling.apply_rotary_pos_emb is not shipped and probe.train.kernels == "vllm"
        run = probe.compare(prompts=prompts_file, taps="input_norm,q_rope")
        assert run.manifest["load"]["train_kernels"] == "vllm"
        assert "vllm" in run.manifest["stacks"]["train"]["settings"]["train_kernels"]
        layers = run.layers_table.set_index(["tap", "layer"])
        assert layers.loc[("input_norm", 0), "frac_equal"] == 1.0  # vLLM's native RMSNorm rounds as transformers'
        assert (layers.frac_equal < 1).any()  # ... but its RoPE kernel does not round as transformers' code does
    finally:
        probe.close()
    assert modeling.apply_rotary_pos_emb is shipped


@pytest.mark.engine
def test_the_engine_kernels_in_the_trainer_make_the_first_norm_bitwise_equal(vllm_probe, prompts_file):
    """The "bitwise" recipe: with vLLM's RMSNorm, add+norm, SiLU-and-mul and rotary kernels in the trainer, layer 0's
    input norm and the rotated queries and keys are bitwise equal across the stacks; what differs is attention and
    GEMMs."""
    probe = vllm_probe.with_trainer(train_kernels="vllm")
    try:
        layers = probe.compare(prompts=prompts_file, taps="all").layers_table.set_index(["tap", "layer"])
    finally:
        probe.close()
    for tap in ("input_norm", "q_rope", "k_rope"):
        assert layers.loc[(tap, 0), "frac_equal"] == 1.0 and layers.loc[(tap, 0), "max_ulp"] == 0, tap
    shipped = vllm_probe.compare(prompts=prompts_file, taps="q_rope").layers_table.set_index(["tap", "layer"])
    assert shipped.loc[("q_rope", 0), "frac_equal"] < 1.0  # as shipped, RoPE rounds differently
