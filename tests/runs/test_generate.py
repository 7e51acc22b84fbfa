"""compare --mode generate: sampled responses through vLLM's decode path vs a teacher-forced trainer forward."""

from __future__ import annotations

import pandas as pd
import pytest
from typer.testing import CliRunner

from divergence_probe.cli import app
from divergence_probe.errors import StackError
from divergence_probe.models import get_family
from divergence_probe.taps import ALL_TAPS, expected_taps

pytestmark = pytest.mark.engine  # every test here starts an engine or runs the tool in a child

QWEN2_TAPS, QWEN3_TAPS = get_family("qwen2").layer_taps, get_family("qwen3").layer_taps
from test_compare_cli import assert_one_line_error

GEN = dict(max_new_tokens=12, samples_per_prompt=2, temperature=1.0)


def test_generate_is_reproducible_and_taps_change_nothing(vllm_probe, prompts_file, tmp_path):
    """The same run twice gives the same bytes; without taps (no hook on any decode step), the same samples,
    logprobs and RL metrics, bit for bit."""
    for name, taps in (("a", "all"), ("b", "all"), ("untapped", "none")):
        vllm_probe.compare(prompts=prompts_file, taps=taps, generate=GEN).write(tmp_path / name)
    for csv in ("tokens.csv", "layers.csv", "summary.csv", "buckets.csv"):
        assert (tmp_path / "a" / csv).read_bytes() == (tmp_path / "b" / csv).read_bytes(), csv
    for csv in ("tokens.csv", "buckets.csv"):
        assert (tmp_path / "a" / csv).read_bytes() == (tmp_path / "untapped" / csv).read_bytes(), csv
    tapped, untapped = (pd.read_csv(tmp_path / name / "summary.csv").iloc[0] for name in ("a", "untapped"))
    assert untapped.first_inexact == "not captured" != tapped.first_inexact
    assert tapped.drop(["first_inexact", "first_over_threshold"]).equals(
        untapped.drop(["first_inexact", "first_over_threshold"]))


def test_decode_path_taps_cover_every_layer_and_response_token(vllm_probe, prompts_file):
    run = vllm_probe.compare(prompts=prompts_file, generate=GEN)
    tokens = run.tokens_table
    assert set(tokens.sample_id) == {0, 1} and tokens.is_response.any() and (~tokens.is_response).any()
    n_layers = vllm_probe.source.num_layers
    want = {(k.name, k.layer) for k in expected_taps(frozenset(ALL_TAPS), n_layers, layer_taps=QWEN3_TAPS)}
    assert set(zip(run.layers_table.tap, run.layers_table.layer)) == want
    response = tokens[tokens.is_response]
    assert (response.delta_logprob != 0).any()  # the decode path disagrees with the trainer too
    summary = run.summary
    assert summary["n_tokens"] == len(response) == summary["n_response_tokens"]
    assert summary["k3"] >= 0 and summary["n_sequences"] == 2 * len(run.prompts)


def test_sampling_settings_change_the_samples(vllm_probe, prompts_file):
    base = vllm_probe.compare(prompts=prompts_file, taps="none", generate=GEN).tokens_table
    greedy = vllm_probe.compare(prompts=prompts_file, taps="none", generate=GEN | {"temperature": 0.0}).tokens_table
    assert not base.token_id.equals(greedy.token_id) or len(base) != len(greedy)


def test_hf_vs_hf_generate_is_exactly_zero_on_responses(hf_probe, prompts_file):
    run = hf_probe.compare(prompts=prompts_file, generate=GEN, batch_invariance=True)
    response = run.tokens_table[run.tokens_table.is_response]
    assert len(response) > 0
    assert (response.delta_logprob == 0).all() and (response.kl == 0).all()
    s = run.summary
    assert s["ratio_min"] == s["ratio_max"] == 1.0 and s["ppo_clip_frac"] == 0 and s["first_inexact"] == "none"
    assert s["dominant_factor"] == "none"  # transformers' samples are scored by a prefill: every factor is 1
    assert list(run.batch_invariance.side) == ["infer", "train"]


def test_the_three_factors_multiply_to_the_ratio_and_a_changed_prefill_moves_its_two(vllm_probe, prompts_file,
                                                                                      monkeypatch):
    """π_train/π_recorded = trainer/prefill × prefill/decode × decode/recorded. With the engine's prefill pass shifted
    by a float32 offset per token (both factors it enters then non-zero), the same samples and trainer logprobs: the shift moves
    trainer/prefill and prefill/decode by opposite amounts and leaves decode/recorded and the ratio alone; on every
    response token the three log-factors, added in order in float64, are delta_logprob to the bit."""
    import numpy as np
    import torch

    from divergence_probe.numerics.rl_metrics import log_factors

    base = vllm_probe.compare(prompts=prompts_file, num_prompts=1, taps="none", generate=GEN)
    score = vllm_probe.infer.score

    def shifted(prompts, taps, sink, on_scored=None):
        scores = score(prompts, taps, sink, on_scored)
        for s in scores:
            s.logprobs = s.logprobs + 0.01 * torch.sin(torch.arange(len(s.logprobs), dtype=torch.float32) + 0.5)
        return scores

    monkeypatch.setattr(vllm_probe.infer, "score", shifted)
    run = vllm_probe.compare(prompts=prompts_file, num_prompts=1, taps="none", generate=GEN)
    before, after = base.tokens_table, run.tokens_table
    assert before.drop(columns="logprob_prefill").equals(after.drop(columns="logprob_prefill"))
    response, old = after[after.is_response], before[before.is_response]
    moved = (response.logprob_prefill - old.logprob_prefill).to_numpy()
    assert (moved != 0).all()
    # the decode logprobs are the recording (logprob_infer): decode/recorded is 1, not a column
    f = log_factors({"train": response.logprob_train, "prefill": response.logprob_prefill,
                     "decode": response.logprob_infer})
    assert (f["train_vs_prefill"] != 0).all() and (f["prefill_vs_decode"] != 0).all()
    assert (f["train_vs_prefill"] + f["prefill_vs_decode"] == response.delta_logprob.to_numpy()).all()
    f0 = log_factors({"train": old.logprob_train, "prefill": old.logprob_prefill, "decode": old.logprob_infer})
    assert (f["prefill_vs_decode"] - f0["prefill_vs_decode"] == moved).all()  # token by token, exactly
    assert (f["train_vs_prefill"] - f0["train_vs_prefill"] == -moved).all()
    s0, s1 = base.summary, run.summary
    for name, values in f.items():
        assert s1[f"{name}_mean_abs_dlogp"] == np.abs(values).mean() and s1[f"{name}_mean_dlogp"] == values.mean()
    assert "decode_vs_recorded_mean_abs_dlogp" not in s1
    assert s1["mean_abs_dlogp"] == s0["mean_abs_dlogp"]


def test_generate_cli_writes_rl_files(qwen3_tiny, prompts_file, tmp_path):
    out_dir = tmp_path / "gen"
    result = CliRunner().invoke(app, ["compare", "--model", str(qwen3_tiny), "--prompts", str(prompts_file),
                                      "--infer", "hf", "--mode", "generate", "--max-new-tokens", "6",
                                      "--batch-invariance", "--taps", "none", "--out", str(out_dir)],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    tokens = pd.read_csv(out_dir / "tokens.csv")
    assert {"sample_id", "is_response"} <= set(tokens.columns)
    summary = pd.read_csv(out_dir / "summary.csv")
    for col in ("k1", "k2", "k3", "ppo_clip_frac", "tis_truncated_frac", "mis_masked_frac", "ess", "ppl_ratio",
                "noise_infer_mean_abs_dlogp", "noise_train_mean_abs_dlogp", "prompt_mean_abs_dlogp"):
        assert col in summary.columns, col
    assert set(pd.read_csv(out_dir / "buckets.csv").group) == {"p_infer", "response_position"}
    assert len(pd.read_csv(out_dir / "batch_invariance.csv")) == 2


def test_bad_generate_flags(qwen3_tiny, tmp_path):
    for flags, message in [(["--mode", "decode"], "--mode"), (["--mode", "generate", "--top-p", "0"], "--top-p"),
                           (["--mode", "generate", "--max-new-tokens", "0"], "--max-new-tokens")]:
        result = CliRunner().invoke(app, ["compare", "--model", str(qwen3_tiny), *flags, "--out", str(tmp_path / "x")])
        assert_one_line_error(result, message)


def test_step_layout_reads_both_vllm_runner_kinds():
    """v1 runners keep a persistent input_batch; model runner V2 (vLLM 0.24 CUDA, Qwen3) only returns its batch from
    prepare_inputs, which is wrapped for the run and restored after. Fakes with the real attribute names."""
    from types import SimpleNamespace

    import numpy as np

    from divergence_probe.engines.hooks import HookSet
    from divergence_probe.engines.vllm.rollout import step_layout
    from vllm_runners import V1Runner

    v1 = V1Runner(
        input_batch=SimpleNamespace(num_reqs=2, req_ids=["a-0", "b-0", None], num_computed_tokens_cpu=np.array([0, 5, 0])),
        query_start_loc=SimpleNamespace(np=np.array([0, 3, 4, 4])),
    )
    with HookSet() as hooks:
        assert step_layout(v1, hooks)() == (["a-0", "b-0"], [0, 3, 4], [0, 5])

    class V2Runner:
        def prepare_inputs(self, scheduler_output, batch_desc):
            return SimpleNamespace(num_reqs=2, req_ids=["b-0", "a-0"], query_start_loc_np=np.array([0, 1, 4, 4]),
                                   num_computed_tokens_np=np.array([6, 0]))

    runner = V2Runner()
    with HookSet() as hooks:
        read = step_layout(runner, hooks)
        with pytest.raises(StackError, match="without prepare_inputs"):
            read()
        runner.prepare_inputs(None, None)  # what the runner does before each forward
        assert read() == (["b-0", "a-0"], [0, 1, 4], [6, 0])
    assert "prepare_inputs" not in vars(runner)  # the wrapper is gone after the run

    with HookSet() as hooks, pytest.raises(StackError, match="no step layout"):
        step_layout(SimpleNamespace(), hooks)

    # under full CUDA graphs V2's decode steps replay without the model call the capture reads (seen on the H200,
    # Qwen3-1.7B shape, FULL_AND_PIECEWISE): refused before sampling, with the fix; PIECEWISE graphs are followed
    for mode, refused in (("FULL_AND_PIECEWISE", True), ("FULL_DECODE_ONLY", True), ("PIECEWISE", False)):
        runner.vllm_config = SimpleNamespace(compilation_config=SimpleNamespace(cudagraph_mode=SimpleNamespace(name=mode)))
        with HookSet() as hooks:
            if refused:
                with pytest.raises(StackError, match="PIECEWISE") as e:
                    step_layout(runner, hooks)
                assert "\n" not in str(e.value)
            else:
                step_layout(runner, hooks)


def test_compared_logprobs_are_raw_whatever_the_sampling_settings(vllm_probe, qwen3_tiny, prompts_file):
    """At temperature 0.5 and top-p 0.5, vLLM's logprob of each sampled token is the plain log-softmax of the
    logits its decode step computed (hooked here, apart from the tool's own capture), not the tempered one; the
    training side's is the log-softmax of a fresh transformers forward over prompt+response."""
    import torch
    from transformers import AutoModelForCausalLM

    steps = []

    def keep(module, args, output):  # one request: each sampling step computes one row of logits
        if output.shape[0] == 1:
            steps.append(output.clone().float()[0])  # a copy: the sampler divides by the temperature in place

    handle = vllm_probe.infer.model.logits_processor.register_forward_hook(keep)
    try:
        run = vllm_probe.compare(prompts=prompts_file, num_prompts=1, taps="none",
                                 generate=dict(max_new_tokens=8, temperature=0.5, top_p=0.5))
    finally:
        handle.remove()
    tokens = run.tokens_table
    response = tokens[tokens.is_response]
    # and one more: the sampling step of the engine's prefill of the whole sequence (logprob_prefill), after the decode
    assert run.manifest["generate"]["temperature"] == 0.5 and len(steps) == len(response) + 1 > 2
    steps = steps[: len(response)]
    targets = torch.tensor(response.token_id.tolist())
    raw = torch.stack([torch.log_softmax(row, -1) for row in steps]).gather(-1, targets[:, None])[:, 0]
    tempered = torch.stack([torch.log_softmax(row / 0.5, -1) for row in steps]).gather(-1, targets[:, None])[:, 0]
    assert response.logprob_infer.tolist() == raw.tolist()
    assert (tempered != raw).all()  # so a tempered logprob could not pass for a raw one

    model = AutoModelForCausalLM.from_pretrained(qwen3_tiny, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    ids = [run.prompts[0].token_ids[0], *tokens.token_id]
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
    fresh = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert tokens.logprob_train.tolist() == fresh.tolist()
