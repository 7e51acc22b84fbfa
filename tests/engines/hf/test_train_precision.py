"""--train-precision amp: the trainer as torch AMP and FSDP mixed precision run it (FP32 master weights, forward under
autocast to BF16). Its forward differs from the pure BF16 trainer's exactly where autocast keeps FP32 (the embedding,
the residual stream, the norms) and not in the GEMM that autocast runs in BF16; the run records it; the memory plan
counts its FP32 weights. No engine: the inference side is a pure BF16 transformers instance of the same checkpoint."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import divergence_probe as dp
from divergence_probe.errors import ProbeError
from divergence_probe.runs.memory import ModelSize, PlanInputs, plan
from divergence_probe.prompts import load_prompts
from divergence_probe.spec import spec_from_flat

U = 2.0 ** -24  # FP32 unit roundoff


@pytest.fixture(scope="module")
def amp_probe(qwen3_tiny):
    """Trainer under AMP beside a pure BF16 transformers instance (the inference side keeps --dtype)."""
    probe = dp.load(str(qwen3_tiny), infer="hf", dtype="bfloat16", device="cpu", train_precision="amp")
    yield probe
    probe.close()


def captured(stack, prompt, taps):
    seen = {}
    [scores] = stack.score([prompt], frozenset(taps), lambda pid, key, x: seen.__setitem__(key.label, x.clone()))
    return seen, scores


def test_amp_differs_from_bf16_where_autocast_keeps_fp32(amp_probe, prompts_file):
    probe = amp_probe
    assert {p.dtype for p in probe.train.model.parameters()} == {torch.float32}  # master weights
    assert {p.dtype for p in probe.infer.model.parameters()} == {torch.bfloat16}
    prompt = load_prompts(prompts_file, probe.tokenizer, max_model_len=probe.settings.max_model_len)[0]
    taps = ("embed", "input_norm", "q_proj", "resid_out", "logits")
    amp, amp_scores = captured(probe.train, prompt, taps)
    pure, pure_scores = captured(probe.infer, prompt, taps)
    # FP32 where autocast leaves ops alone: the embedding (an exact upcast of the same BF16 values), the residual
    # stream and the norms; the GEMMs (q_proj, the head) in BF16
    assert torch.equal(amp["embed@-1"], pure["embed@-1"].float())
    assert amp["input_norm@0"].dtype == amp["resid_out@0"].dtype == torch.float32
    logits = f"logits@{probe.source.num_layers}"
    assert amp["q_proj@0"].dtype == amp[logits].dtype == torch.bfloat16 == pure["q_proj@0"].dtype
    # layer 0's input norm: AMP computes RMSNorm of the (exact) embedding in FP32 and keeps it, within the FP32 bound
    # of the float64 formula (mean of `width` squares, rsqrt, two products: (width + 8) U, test_regions' rms_eps);
    # pure BF16 rounds it, and is outside that bound somewhere
    norm = probe.train.model.model.layers[0].input_layernorm
    s = amp["embed@-1"].double()
    exact = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon) * norm.weight.double()
    bound = (s.shape[-1] + 8) * U * exact.abs()
    assert ((amp["input_norm@0"].double() - exact).abs() <= bound).all()
    assert not ((pure["input_norm@0"].double() - exact).abs() <= bound).all()
    # q_proj: autocast's BF16 GEMM of the FP32 norm output rounded to BF16, with the same BF16 weights, bit for bit
    q = probe.train.model.model.layers[0].self_attn.q_proj
    with torch.inference_mode():
        assert torch.equal(amp["q_proj@0"], F.linear(amp["input_norm@0"].bfloat16(), q.weight.bfloat16()))
    assert not torch.equal(amp["q_proj@0"], pure["q_proj@0"])  # the differing norm reaches the GEMM's input
    assert not torch.equal(amp_scores.logprobs, pure_scores.logprobs)


def test_amp_is_recorded_and_its_logprobs_are_the_amp_trainers(amp_probe, prompts_file):
    run = amp_probe.compare(prompts=prompts_file, taps="none")
    manifest = run.manifest
    assert manifest["spec"]["load"]["train_precision"] == manifest["load"]["train_precision"] == "amp"
    prompt = load_prompts(prompts_file, amp_probe.tokenizer, max_model_len=amp_probe.settings.max_model_len)[0]
    [scores] = amp_probe.train.score([prompt], frozenset(), lambda *a: None)
    rows = run.tokens_table[run.tokens_table.prompt_id == prompt.prompt_id]
    assert torch.equal(torch.tensor(rows["logprob_train"].values, dtype=torch.float32), scores.logprobs)
    assert run.summary["mean_abs_dlogp"] > 0  # AMP vs pure BF16 of the same weights: not the zero baseline


def test_the_plan_counts_the_amp_trainers_fp32_weights(amp_probe):
    size = ModelSize.of(amp_probe.source.config, amp_probe.source.family)
    inputs = dict(model=size, dtype_bytes=2, taps=frozenset(), prompt_lengths=(64,), batch_tokens=64,
                  batch_tokens_fixed=True, max_model_len=amp_probe.settings.max_model_len, device="cpu",
                  free_bytes=1 << 40, free_source="test", engine_kv=False)
    pure, amp = plan(PlanInputs(**inputs)), plan(PlanInputs(**inputs, train_amp=True))
    storages = {t.data_ptr(): t.nbytes for t in amp_probe.train.model.state_dict().values()}  # tied weights once
    assert amp.terms["train_weights"] == sum(storages.values()) == 2 * pure.terms["train_weights"]
    assert amp.terms["train_amp_weight_casts"] == pure.terms["train_weights"]  # autocast's cached BF16 casts
    assert amp.needed > pure.needed
    assert amp_probe.memory_plan.inputs.train_amp


@pytest.mark.parametrize("flags, fragment", [
    ({"train_precision": "amp", "dtype": "float32"}, "--train-precision amp autocasts an FP32 model"),
    ({"train_precision": "amp", "taps": "all"}, "add --taps none"),
    ({"train_precision": "amp", "taps": "none", "graft": True}, "drop --graft/--depth"),
    ({"train_precision": "fp8"}, "--train-precision 'fp8' is not valid"),
])
def test_what_amp_cannot_do_is_refused_in_one_line(flags, fragment):
    with pytest.raises(ProbeError) as e:
        spec_from_flat("compare", **flags)
    assert fragment in str(e.value) and "\n" not in str(e.value)
    assert spec_from_flat("compare", train_precision="amp", taps="logits").load.train_precision == "amp"


def test_rl_trainer_under_amp_pushes_what_it_computes_with(amp_probe):
    """rl's trainer on an AMP stack: after an update, the FP32 model is the FP32 masters and the weights pushed to the
    engine are those masters rounded to BF16 (the values autocast computes with), not FP32 tensors."""
    from dataclasses import replace

    from divergence_probe.spec.rl import rl_spec
    from divergence_probe.rl.loop import load_spec
    from divergence_probe.rl.trainer import Trainer
    from divergence_probe.engines.hf.trainer import HFStack

    assert load_spec(rl_spec(train_precision="amp")).train_precision == "amp"
    stack = HFStack()
    stack.load(replace(amp_probe.settings))
    trainer = Trainer(stack, lr=1e-2, grad_clip=1.0)
    logp, _, mask, _ = trainer.forward([(1, 5, 9, 3, 7), (2, 4, 6)], [2, 2])
    assert logp.dtype == torch.float32 and logp.requires_grad
    trainer.step(-(logp * mask).sum() / mask.sum())
    pushed = trainer.named_weights()
    for name, p, m in zip(trainer.names, trainer.params, trainer.master):
        assert p.dtype == torch.float32 and torch.equal(p.detach(), m.detach())
        assert pushed[name].dtype == torch.bfloat16 and torch.equal(pushed[name], m.detach().bfloat16())
    assert any(not torch.equal(m.detach(), m.detach().bfloat16().float()) for m in trainer.master)  # FP32 moves
    stack.close()
