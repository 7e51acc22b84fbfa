"""--reference: each stack's taps and logprobs against the checkpoint run in float64/float32, on answers known
without the tool (two identical transformers stacks, an error injected into one of them, a region whose rounding
count is known)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

import divergence_probe as dp
from divergence_probe.numerics.reference import NOT_DETECTED, TIE, TRAIN, TRAIN_FURTHER, in_words

pytestmark = pytest.mark.engine  # the tap reduction compiles

TAPS = "input_norm,mlp_out,resid_out,logits"


@pytest.fixture(scope="module")
def twenty_prompts(tmp_path_factory):
    """As few prompts as an interval over prompts is given on (shapley.MIN_PROMPTS), each short."""
    path = tmp_path_factory.mktemp("reference") / "prompts.txt"
    path.write_text("\n\n".join(f"Prompt {i}: rounding {i * 7} to BF16 loses {i % 5} bits." for i in range(20)))
    return path


@pytest.fixture(scope="module")
def baseline(hf_probe, twenty_prompts):
    return hf_probe.compare(prompts=twenty_prompts, taps=TAPS, reference="float64")


def test_two_identical_stacks_are_equally_far_from_float64(baseline, qwen3_tiny):
    layers, tokens, s = baseline.layers_table, baseline.tokens_table, baseline.summary
    assert (layers["ref_err_infer"] == layers["ref_err_train"]).all() and (layers["closer_to_ref"] == TIE).all()
    assert (layers["ref_err_infer"] > 0).all()  # BF16 is not exact
    assert (tokens["closer_to_ref"] == TIE).all()
    local = baseline.files()["reference_local.csv"]  # the local reading: each stack's ops on the reference's inputs
    assert len(local) > len(layers) and (local["closer_to_ref"] == TIE).all() and (local["ref_err_train"] > 0).all()
    assert s["ref_ratio"] == 1 and s["ref_verdict"] == NOT_DETECTED and s["ref_within_k"]
    assert "neither stack is detectably further from exact" in in_words(s)
    # the reference's logprobs are the float64 checkpoint's, computed here without the tool
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(qwen3_tiny), dtype=torch.float64, attn_implementation="eager")
    ids = baseline.prompts[0].token_ids
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()
    got = tokens[tokens["prompt_id"] == baseline.prompts[0].prompt_id]["logprob_ref"].to_numpy()
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-12)
    assert baseline.manifest["reference"]["precision"] == "float64"


def test_an_error_injected_into_one_stack_shows_in_that_stacks_error_only(hf_probe, twenty_prompts, baseline,
                                                                         tmp_path):
    norm = hf_probe.train.model.model.layers[1].input_layernorm
    handle = norm.register_forward_hook(lambda module, args, output: output * 1.05)  # 5% off, in the trainer only
    try:
        run = hf_probe.compare(prompts=twenty_prompts, taps=TAPS, reference="float64")
    finally:
        handle.remove()
    layers, base = run.layers_table, baseline.layers_table
    pd.testing.assert_series_equal(layers["ref_err_infer"], base["ref_err_infer"])  # the engine's error untouched
    before = layers["layer"] < 1
    pd.testing.assert_series_equal(layers["ref_err_train"][before], base["ref_err_train"][before])
    injected = layers[(layers["layer"] == 1) & (layers["tap"] == "input_norm")].iloc[0]
    # 5% of every value on top of what the stack rounds: by the triangle inequality the trainer's rel_l2 is 0.05 to
    # within the engine's error (the same stack's rounding) and one more rounding of the scaled output (the floor)
    assert injected["closer_to_ref"] == "infer"
    assert abs(injected["ref_err_train"] - 0.05) <= injected["ref_err_infer"] + injected["ref_floor"]
    s = run.summary
    assert s["ref_at"] == "input_norm@1" and s["ref_further"] == TRAIN
    assert s["ref_verdict"] == TRAIN_FURTHER and s["ref_ratio_ci_low"] > 1 and not s["ref_within_k"]
    # the local reading puts the error on the one op it was injected into, where the accumulated one shows it from
    # there on
    local = run.files()["reference_local.csv"]
    hit = (local["layer"] == 1) & (local["tap"] == "input_norm")
    assert (local[~hit]["ref_err_infer"] == local[~hit]["ref_err_train"]).all()
    op = local[hit].iloc[0]
    assert op["closer_to_ref"] == "infer" and abs(op["ref_err_train"] - 0.05) <= op["ref_err_infer"] + op["ref_floor"]
    # the run folder holds both readings, and the report leads with the verdict
    from divergence_probe.reports.load import load_run
    from divergence_probe.reports.reference import reference_section

    run.write(tmp_path / "run")
    blocks = reference_section(load_run(tmp_path / "run"))
    assert blocks[0].text == "Which side is further from exact" and blocks[1].text == in_words(s)
    assert (tmp_path / "run" / "reference_local.csv").is_file()
    assert "the training stack is further from exact" in in_words(s)


def test_a_reference_at_the_stacks_own_precision_measures_them_as_exactly_zero(qwen3_tiny, prompts_file):
    """The reference's machinery at float32 beside float32 stacks (a run cannot ask for it: a reference no finer than
    --dtype is refused, spec/run.py): every tap is the reference's to the bit."""
    from divergence_probe.runs.compare import run_compare
    from divergence_probe.runs.reference import ReferenceArm
    from divergence_probe.spec.run import spec_from_flat

    with dp.load(str(qwen3_tiny), infer="hf", dtype="float32", device="cpu", train_attn="eager") as probe:
        spec = spec_from_flat("compare", load=probe.config, prompts=str(prompts_file),
                              taps="input_norm,q_rope,attn_core,resid_out,logits", reference="float64")
        arm = ReferenceArm(probe, "float32")  # the run's float64 arm in its place
        try:
            run = run_compare(probe, spec, reference=arm)
        finally:
            arm.close()
    layers, tokens = run.layers_table, run.tokens_table
    for column in ("ref_err_infer", "ref_err_train", "ref_floor"):
        assert (layers[column] == 0).all(), column
    # the logits are the reference's to the bit; what is left is the stacks' FP32 log_softmax, which the floor takes too
    assert (tokens["ref_err_infer"] == tokens["ref_floor"]).all() and (tokens["ref_err_train"] == tokens["ref_floor"]).all()
    s = run.summary
    assert s["ref_at"] == "logprobs" and s["ref_err_infer"] == s["ref_err_train"] == s["ref_floor"] > 0


def test_ablate_rmsnorm_on_the_trainer_leaves_it_one_rounding_from_float64(hf_probe, prompts_file):
    """Aligned, the trainer's input_norm@0 is computed in FP32 from the exact embedding and rounded once: its error
    against float64 is the floor (the reference rounded once), where as shipped it rounds more than once; the
    engine's error does not move."""
    run = hf_probe.ablate(prompts=prompts_file, taps="input_norm", regions="rmsnorm", side="train",
                          reference="float64", bootstrap=0)
    layers = run.layers_table
    norm0 = layers[(layers["tap"] == "input_norm") & (layers["layer"] == 0)].set_index("combo")
    shipped, aligned = norm0.loc["none"], norm0.loc["rmsnorm"]
    assert shipped["ref_err_train"] == shipped["ref_err_infer"] > 1.2 * shipped["ref_floor"]
    assert aligned["ref_err_infer"] == shipped["ref_err_infer"]
    assert aligned["ref_floor"] == shipped["ref_floor"]
    assert aligned["ref_err_train"] == pytest.approx(aligned["ref_floor"], rel=1e-2)
    summary = run.summary_table.set_index("combo")
    assert summary.loc["rmsnorm", "ref_logprob_err_infer"] == summary.loc["none", "ref_logprob_err_infer"]


def test_rmsnorm_aligned_on_both_sides_leaves_vllm_and_transformers_equally_far_at_input_norm_0(vllm_probe,
                                                                                               prompts_file):
    """Aligned on both sides, each stack's first input norm rounds the same FP32 result once: the two errors against
    float64 are equal. The engine does not run its ops on given inputs, so its local reading is empty."""
    run = vllm_probe.compare(prompts=prompts_file, taps="input_norm,logits", align="rmsnorm", side="both",
                             reference="float64")
    layers = run.layers_table
    norm0 = layers[(layers["tap"] == "input_norm") & (layers["layer"] == 0)].iloc[0]
    assert norm0["frac_equal"] == 1 and norm0["ref_err_infer"] == norm0["ref_err_train"] > 0
    local = run.files()["reference_local.csv"]
    assert local["ref_err_infer"].isna().all() and (local["closer_to_ref"] == "").all()
    assert (local["ref_err_train"] > 0).all()
    assert run.manifest["reference"]["local"]["stacks"] == ["train"]


def test_the_float64_reference_is_exact_far_below_the_floor(monkeypatch):
    """transformers takes eager attention's softmax and RMSNorm in float32 (an upcast for BF16, a downcast for a
    float64 model), so a float64 reference is not float64 throughout: its logits against the same forward with those
    two ops in float64 must stay a thousand times below the floor (the exact logits rounded once to BF16) for the
    reference to tell which stack is wrong."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3 import modeling_qwen3

    from divergence_probe.runs.reference import ATTENTION

    model = AutoModelForCausalLM.from_pretrained(dp.__path__[0] + "/data/default_model", dtype=torch.float64,
                                                 attn_implementation=ATTENTION).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 512), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        as_run = model(ids).logits[0]
    softmax = torch.nn.functional.softmax

    def softmax_in_float64(x, dim=None, dtype=None, **kwargs):
        return softmax(x, dim=dim, dtype=x.dtype if x.dtype == torch.float64 else dtype, **kwargs)

    def norm_in_float64(self, h):
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(torch.nn.functional, "softmax", softmax_in_float64)
    monkeypatch.setattr(modeling_qwen3.Qwen3RMSNorm, "forward", norm_in_float64)
    with torch.no_grad():
        exact = model(ids).logits[0]
    assert as_run.dtype == exact.dtype == torch.float64
    error = ((as_run - exact).norm() / exact.norm()).item()
    floor = ((exact.to(torch.bfloat16).double() - exact).norm() / exact.norm()).item()
    assert 0 < error < floor / 1000, (error, floor)  # > 0: the float32 steps are there, and the patches took


def test_a_mixture_of_experts_has_a_float64_reference(qwen3_moe_tiny, twenty_prompts):
    """transformers' default experts kernel (a grouped matmul) takes no float64: the reference runs its experts one
    by one, so a mixture's float64 reference loads and scores, with the same verdict words as a dense model's."""
    probe = dp.load(str(qwen3_moe_tiny), infer="hf", dtype="bfloat16", device="cpu")
    try:
        run = probe.compare(prompts=twenty_prompts, num_prompts=3, taps="none", reference="float64")
    finally:
        probe.close()
    reference = run.manifest["reference"]
    assert reference["experts"] == "eager" == reference["stack"]["implementations"]["experts"]
    logprobs = run.tokens_table["logprob_ref"].to_numpy()
    assert len(logprobs) and np.isfinite(logprobs).all() and (logprobs <= 0).all()
