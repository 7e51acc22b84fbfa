"""--placement: the memory plan's choice between both stacks together and one at a time, the bytes of the engine's
outputs it keeps on the host meanwhile, where it keeps them, and the one-line refusals, all before anything loads."""

from __future__ import annotations

from dataclasses import replace

import pytest

from divergence_probe.errors import DeviceMemoryError, ProbeError
from divergence_probe.models import get_family
from divergence_probe.models.modelzoo import make_config
from divergence_probe.runs import memory as memory_plan
from divergence_probe.runs.memory import GiB, ModelSize, PlanInputs, placed
from divergence_probe.runs.reference_plan import check_planned
from divergence_probe.spec import spec_from_flat

# the Qwen3-30B-A3B shape: 48 layers, 128 experts of which 8 per token
QWEN3_30B_A3B = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                 "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                 "vocab_size": 151936, "num_experts": 128, "num_experts_per_tok": 8, "tie_word_embeddings": False}


def inputs(free: int, **changes) -> PlanInputs:
    size = ModelSize.of(QWEN3_30B_A3B, get_family("qwen3_moe"))
    base = dict(model=size, dtype_bytes=2, taps=frozenset(size.tap_widths()), prompt_lengths=(300,) * 8,
                batch_tokens=8192, batch_tokens_fixed=False, max_model_len=4096, device="cuda", free_bytes=free,
                free_source="test")
    return PlanInputs(**(base | changes))


def test_auto_keeps_both_together_when_they_fit():
    p, why = placed(inputs(10**15), "auto")
    assert not p.inputs.alternate and p.fits and why.startswith("both stacks fit together")


def test_auto_alternates_when_only_one_stack_fits():
    """An 80 GB device holds the 30B weights once, not twice: auto picks one stack at a time and says why."""
    together, _ = placed(inputs(80 * 10**9), "together")
    p, why = placed(inputs(80 * 10**9), "auto")
    assert not together.fits and p.fits and p.inputs.alternate
    assert p.needed < together.needed and "one at a time" in why
    weights = p.inputs.model.parameters * 2
    # the engine's phases hold no trainer and the trainer's phase holds no engine
    assert p.phases["engine_start"] < together.phases["engine_start"] - weights // 2
    assert p.phases["train_and_reduce"] <= together.phases["train_and_reduce"] - p.terms["infer_weights"]


def test_weights_take_no_fragmentation_allowance():
    """Weights are allocated once, whole: a checkpoint larger by W bytes needs W more, under either placement."""
    more = 10**9
    for asked in ("together", "alternate"):
        p, _ = placed(inputs(10**15), asked)
        heavier, _ = placed(inputs(10**15, model=replace(p.inputs.model, parameters=p.inputs.model.parameters
                                                           + more // 2)), asked)
        assert heavier.batch_tokens == p.batch_tokens
        copies = 1 if asked == "alternate" else 2  # one stack's weights on the device at a time, or both
        assert heavier.needed - p.needed == copies * more


def test_alternate_holds_the_32b_shape_on_an_80gb_device():
    """One stack at a time: the trainer's phase holds its own weights and its own allocations' slack, nothing of the
    engine that left, so the Qwen2.5-32B shape (65.5 GB of weights) fits 78.7 GiB with short prompts."""
    size = ModelSize.of(make_config(preset="qwen2.5-32b").to_dict(), get_family("qwen2"))
    p, why = placed(inputs(int(78.7 * GiB), model=size, taps=frozenset(size.tap_widths()), prompt_lengths=(256,) * 8),
                    "auto")
    assert p.fits and p.inputs.alternate, why


def test_alternate_counts_the_outputs_passing_through_this_process():
    """The worker's outputs come back through this process's device while the worker holds its own copy: at the
    Qwen3-30B-A3B shape, 16 prompts of 512 tokens, a batch of 8192 tokens ran out of memory in the engine's pass on an
    80 GB H100 and 2048 ran (docs/results/h100/full-depth/): the plan must not pick the larger batches."""
    p, why = placed(inputs(int(78.7 * GiB), prompt_lengths=(512,) * 16), "auto")
    assert p.fits and p.inputs.alternate, why
    assert p.batch_tokens <= 2048


def test_auto_together_when_the_run_cannot_alternate():
    p, why = placed(inputs(80 * 10**9), "auto", can_alternate=False)
    assert not p.inputs.alternate and not p.fits and "both stacks at once" in why
    with pytest.raises(DeviceMemoryError):
        memory_plan.check(p)


def test_neither_fits_refused_naming_the_placement():
    p, _ = placed(inputs(30 * 10**9), "auto")
    with pytest.raises(DeviceMemoryError, match="one stack at a time"):
        memory_plan.check(p)


def test_kept_bytes_grow_with_passes_and_floors():
    p, _ = placed(inputs(80 * 10**9), "alternate")
    once = memory_plan.kept_output_bytes(p)
    size = p.inputs.model
    rows = sum(p.inputs.prompt_lengths)
    assert once >= rows * size.tap_elements_per_token(p.inputs.taps) * 2  # every tap of every prompt
    twice, _ = placed(inputs(80 * 10**9, engine_passes=2), "alternate")
    assert memory_plan.kept_output_bytes(twice) == 2 * once
    floors, _ = placed(inputs(80 * 10**9, noise_floor=True), "alternate")
    assert memory_plan.kept_output_bytes(floors) > once


def test_kept_on_host_then_file_then_refused(monkeypatch, tmp_path):
    p, _ = placed(inputs(80 * 10**9), "alternate")
    kept = memory_plan.kept_output_bytes(p)
    monkeypatch.setenv(memory_plan.HOST_ENV, str(kept))
    assert memory_plan.keep_where(p, str(tmp_path))["kept"] == "host"
    monkeypatch.setenv(memory_plan.HOST_ENV, str(kept - 1))
    assert memory_plan.keep_where(p, str(tmp_path))["kept"] == "file"
    monkeypatch.setattr("shutil.disk_usage", lambda path: type("U", (), {"free": kept - 1})())
    with pytest.raises(DeviceMemoryError) as e:
        memory_plan.keep_where(p, str(tmp_path))
    assert "nothing was loaded" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("flags, fragment", [
    ({"graft": True}, "--graft run the trainer's ops"),
    ({"depth": True}, "--depth run the trainer's ops"),
    ({"train_device": "cpu"}, "drop --train-tp/--train-device"),
    ({"infer": "hf", "reference": "float64"}, "--reference measures --infer hf's own ops"),
])
def test_what_needs_both_stacks_refused_in_one_line(flags, fragment):
    with pytest.raises(ProbeError) as e:
        spec_from_flat("compare", placement="alternate", **flags)
    assert fragment in str(e.value) and "--placement together" in str(e.value) and "\n" not in str(e.value)


def test_auto_keeps_both_together_when_the_reference_replays_the_engine():
    """--infer hf replays its ops on the reference's inputs in the trainer's pass: auto never sends it away."""
    from divergence_probe.runs.loading import _can_alternate

    assert _can_alternate((spec := spec_from_flat("compare", infer="hf")).load, spec)
    assert not _can_alternate((spec := spec_from_flat("compare", infer="hf", reference="float64")).load, spec)
    assert _can_alternate((spec := spec_from_flat("compare", reference="float64")).load, spec)  # vLLM replays none


# --reference: the checkpoint in float64/float32 beside the stacks, at the Qwen2.5-7B shape (a BF16 run of 24 prompts
# of 512 tokens, every tap), the shape it was measured on
QWEN25_7B = {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
             "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False}


def reference_inputs(free: int, reference: str | None, **changes) -> PlanInputs:
    size = ModelSize.of(QWEN25_7B, get_family("qwen2"))
    return inputs(free, model=size, taps=frozenset(size.tap_widths()) | {"logits"}, prompt_lengths=(512,) * 24,
                  batch_tokens=512, batch_tokens_fixed=True, max_model_len=32768, reference=reference, **changes)


def test_the_reference_is_counted_where_it_is_held():
    """Together, the reference's weights sit beside the engine's steps and its batch beside the trainer's; one at a
    time it loads after the engine has left, so the engine's phases are those of a run without it. Its forward of a
    batch is a phase of its own, before the trainer runs the batch. On a trainer's device of its own, it is that
    device's."""
    from divergence_probe.numerics.reference import reference_bytes

    size = ModelSize.of(QWEN25_7B, get_family("qwen2"))
    for asked in ("together", "alternate"):
        bare, _ = placed(reference_inputs(10**15, None), asked)
        p, _ = placed(reference_inputs(10**15, "float32"), asked)
        weights, batch = p.terms["reference_weights"], p.terms["reference_batch"]
        forward = p.terms["reference_forward"]
        assert weights == 4 * size.parameters and weights + batch + forward == reference_bytes(size, "float32", 512,
                                                                                             512)
        assert p.phases["engine_step"] - bare.phases["engine_step"] == (weights if asked == "together" else 0)
        assert p.phases["engine_start"] == bare.phases["engine_start"]  # the engine started before it loaded
        assert p.phases["train_and_reduce"] - bare.phases["train_and_reduce"] >= weights + batch
        # the reference's forward beside the trainer's weights (and the engine's, together) and the engine's batch
        beside = bare.terms["train_weights"] + (bare.terms["infer_weights"] + bare.kv_cache_bytes
                                                if asked == "together" else 0) + bare.terms["infer_taps"]
        assert p.phases["reference_forward"] >= beside + weights + batch + forward
        assert "reference_forward" not in bare.phases
        record = p.record()
        assert record["inputs"]["reference"] == "float32" and record["terms_bytes"]["reference_weights"] == weights
    assert "reference_weights" not in bare.terms and bare.record()["inputs"]["reference"] is None
    apart = memory_plan.plan(reference_inputs(10**15, "float64", train_device="cuda:1", train_free_bytes=10**15))
    assert "reference_weights" not in apart.terms and apart.train_terms["reference_weights"] == 8 * size.parameters
    assert "reference_forward" not in apart.phases and apart.train_phases["reference_forward"] >= sum(
        apart.train_terms[t] for t in ("train_weights", "reference_weights", "reference_batch", "reference_forward"))


def test_auto_alternates_when_the_reference_fits_only_beside_the_trainer():
    """Both stacks fit together and the reference does not fit beside them, but it does beside the trainer alone:
    auto places one stack at a time and says why, rather than refusing."""
    free = int(60 * GiB)
    assert placed(reference_inputs(free, None), "auto")[0].inputs.alternate is False
    together, _ = placed(reference_inputs(free, "float32"), "together")
    p, why = placed(reference_inputs(free, "float32"), "auto")
    assert not together.fits and p.fits and p.inputs.alternate
    assert "--reference float32" in why and "one at a time" in why
    assert check_planned(p) is p


def test_a_reference_that_fits_nowhere_is_refused_in_one_line_naming_the_fixes():
    """float64 where float32 fits is told to use float32; a reference that fits in no precision is told to drop it
    or give the trainer (and so the reference) a device of its own; both before anything loads."""
    for free, reference, float32_fits in ((int(60 * GiB), "float64", True), (int(40 * GiB), "float32", False),
                                          (int(40 * GiB), "float64", False)):
        p, _ = placed(reference_inputs(free, reference), "auto")
        assert not p.fits and placed(reference_inputs(free, None), "auto")[0].fits
        with pytest.raises(DeviceMemoryError) as e:
            check_planned(p)
        line = str(e.value)
        assert line.startswith(f"--reference {reference} needs about") and "\n" not in line
        assert "nothing was loaded" in line and "--train-device cuda:1" in line and "no --reference (fits)" in line
        assert ("--reference float32 (fits)" in line) == float32_fits


def test_a_loaded_probe_refuses_alternate():
    """load() (and rl, which loads through it) holds both stacks: refused before anything resolves or loads."""
    import divergence_probe as dp

    with pytest.raises(ProbeError, match="--placement together"):
        dp.load("no-such-model", placement="alternate")


def test_placement_choice_checked():
    with pytest.raises(ProbeError, match="--placement 'apart' is not valid"):
        spec_from_flat("compare", placement="apart")


def test_refusals_are_one_cli_line_before_anything_loads(qwen3_tiny, prompts_file, tmp_path, monkeypatch):
    """--graft under alternate, and outputs that fit neither the host nor the disk: one line, exit 2, nothing written,
    no stack loaded."""
    from typer.testing import CliRunner

    import divergence_probe.runs.loading as loading
    from divergence_probe.cli import app

    def no_stack(*args, **kwargs):
        raise AssertionError("a stack was loaded although the run was refused")

    monkeypatch.setattr(loading, "stack_for", no_stack)
    base = ["compare", "--model", str(qwen3_tiny), "--prompts", str(prompts_file), "--device", "cpu",
            "--placement", "alternate"]
    monkeypatch.setenv(memory_plan.HOST_ENV, "1")
    monkeypatch.setattr("shutil.disk_usage", lambda path: type("U", (), {"free": 1})())
    for extra, fragment in ((["--graft"], "use --placement together"), ([], "keeps the engine's outputs")):
        out_dir = tmp_path / f"run{len(extra)}"
        result = CliRunner().invoke(app, [*base, *extra, "--out", str(out_dir)], catch_exceptions=False)
        lines = result.output.strip().splitlines()
        assert result.exit_code == 2 and len(lines) == 1 and fragment in lines[0], result.output
        assert not out_dir.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(f".{out_dir.name}.")]
