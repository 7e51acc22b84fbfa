"""compare through the Python API, against the real vLLM engine and real transformers (tiny Qwen3)."""

from __future__ import annotations

import torch

from divergence_probe.taps import ALL_TAPS, expected_taps


def test_hf_vs_hf_is_exactly_zero_everywhere(hf_probe, prompts_file):
    run = hf_probe.compare(prompts=prompts_file, taps="all")
    tokens, layers = run.tokens_table, run.layers_table
    assert len(tokens) > 20
    assert (tokens["delta_logprob"] == 0).all() and (tokens["kl"] == 0).all()
    assert (layers["frac_equal"] == 1).all() and (layers["max_abs"] == 0).all() and (layers["max_ulp"] == 0).all()
    assert run.summary["first_inexact"] == "none"


def test_every_canonical_tap_exists_for_every_layer_qwen3(vllm_probe, prompts_file):
    run = vllm_probe.compare(prompts=prompts_file, taps="all")
    n_layers = vllm_probe.source.num_layers
    got = {(row.tap, row.layer) for row in run.layers_table.itertuples()}
    want = {(k.name, k.layer) for k in expected_taps(frozenset(ALL_TAPS), n_layers, has_qk_norm=True)}
    assert got == want
    assert {"q_norm", "k_norm"} <= {tap for tap, _ in got}
    # every tap saw every token of every prompt (logits: every scored position)
    n_tokens = sum(len(p.token_ids) for p in run.prompts)
    assert len(run.tokens) == n_tokens - len(run.prompts)


def test_vllm_and_transformers_differ_and_match_independent_computation(vllm_probe, qwen3_tiny, prompts_file):
    """The tool's numbers equal vLLM's own prompt logprobs and transformers' own forward, with no hooks."""
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    run = vllm_probe.compare(prompts=prompts_file, taps="all")
    tokens = run.tokens_table
    assert (tokens["delta_logprob"] != 0).any() and run.summary["mean_kl"] > 0

    llm = vllm_probe.infer.llm  # same engine, no hooks installed outside a capture
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=list(p.token_ids)) for p in run.prompts],
        SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False), use_tqdm=False,
    )
    model = AutoModelForCausalLM.from_pretrained(qwen3_tiny, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    for prompt, out in zip(run.prompts, outs):
        mine = tokens[tokens.prompt_id == prompt.prompt_id]
        vllm_lp = [entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:], prompt.token_ids[1:])]
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([prompt.token_ids])).logits[0, :-1]
        hf_lp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(prompt.token_ids[1:])[:, None])[:, 0]
        assert mine["logprob_infer"].tolist() == vllm_lp
        assert mine["logprob_train"].tolist() == hf_lp.tolist()
        assert mine["delta_logprob"].tolist() == (hf_lp.double() - torch.tensor(vllm_lp).double()).tolist()


def test_captured_logits_reproduce_vllm_logprobs_exactly_on_cpu(vllm_probe, prompts_file):
    run = vllm_probe.compare(prompts=prompts_file, taps="logits")
    assert run.manifest["stacks"]["infer"]["settings"]["captured_logits_vs_reported_logprobs_max_gap"] == 0.0


def test_taps_do_not_change_logprobs(vllm_probe, prompts_file):
    tapped = vllm_probe.compare(prompts=prompts_file, taps="all").tokens_table
    untapped = vllm_probe.compare(prompts=prompts_file, taps="none").tokens_table
    assert tapped.equals(untapped)


def test_same_inputs_same_bytes(vllm_probe, prompts_file, tmp_path):
    for name in ("a", "b"):
        vllm_probe.compare(prompts=prompts_file, taps="all").write(tmp_path / name)
    for csv in ("tokens.csv", "layers.csv", "summary.csv", "prompts.jsonl"):
        assert (tmp_path / "a" / csv).read_bytes() == (tmp_path / "b" / csv).read_bytes(), csv


def test_first_divergence_is_reported_in_forward_order(vllm_probe, prompts_file):
    run = vllm_probe.compare(prompts=prompts_file, taps="all")
    layers = run.layers_table
    first = run.summary["first_inexact"]
    tap, layer = first.split("@")
    idx = layers.index[(layers.tap == tap) & (layers.layer == int(layer))][0]
    assert (layers.loc[: idx - 1, "frac_equal"] == 1).all() and layers.loc[idx, "frac_equal"] < 1
    # the embedding lookup is a copy of the same weights on both sides
    assert layers.loc[0, "tap"] == "embed" and layers.loc[0, "frac_equal"] == 1


def test_batches_do_not_change_results(vllm_probe, prompts_file):
    """Pairing taps across inference batches of different sizes gives the same per-tap aggregates."""
    import dataclasses

    from divergence_probe.compare import CompareOptions, run_compare

    one_batch = run_compare(vllm_probe, CompareOptions(prompts=prompts_file, taps="resid_out,logits"))
    small = dataclasses.replace(vllm_probe, settings=dataclasses.replace(vllm_probe.settings, batch_tokens=1))
    per_prompt = run_compare(small, CompareOptions(prompts=prompts_file, taps="resid_out,logits"))
    assert list(per_prompt.layers_table["tap"]) == list(one_batch.layers_table["tap"])
    assert len(per_prompt.tokens) == len(one_batch.tokens)
