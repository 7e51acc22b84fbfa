"""compare through the Python API, against the real vLLM engine and real transformers (tiny Qwen3)."""

from __future__ import annotations


import pytest
import torch

from divergence_probe.compare import PendingScores, ScoredSequence
from divergence_probe.errors import NumericsError
from divergence_probe.metrics import token_logprobs
from divergence_probe.prompts import Prompt
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


def test_taps_kept_without_a_clone_are_never_written_again(vllm_probe, prompts_file, monkeypatch):
    """vLLM's taps are cloned only where vLLM may overwrite the buffer later (vllm.REWRITTEN): with every tap
    cloned, every statistic is the same. A tap wrongly left out of REWRITTEN is paired after vLLM overwrote it
    (on this CPU build: q_norm and k_norm, which RoPE rotates in place; its fused add+norm is out of place)."""
    from divergence_probe.stacks import vllm as vllm_stack
    from divergence_probe.taps import ALL_TAPS

    selective = vllm_probe.compare(prompts=prompts_file, taps="all").layers_table
    monkeypatch.setattr(vllm_stack, "REWRITTEN", frozenset(ALL_TAPS))
    cloned = vllm_probe.compare(prompts=prompts_file, taps="all").layers_table
    assert selective.equals(cloned)


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

    from divergence_probe.compare import run_compare

    spec = vllm_probe._spec("compare", None, dict(prompts=prompts_file, taps="resid_out,logits"))
    one_batch = run_compare(vllm_probe, spec)
    small = dataclasses.replace(vllm_probe, settings=dataclasses.replace(vllm_probe.settings, batch_tokens=1))
    per_prompt = run_compare(small, spec)
    assert list(per_prompt.layers_table["tap"]) == list(one_batch.layers_table["tap"])
    assert len(per_prompt.tokens) == len(one_batch.tokens)


def test_training_stack_captures_a_batch_under_one_set_of_hooks(hf_probe, prompts_file, monkeypatch):
    """Hooks are installed once per score call, every tap is filed under the prompt that made it, each prompt's
    scores arrive (in order) before the next prompt runs, and no hook outlives the call."""
    from divergence_probe.prompts import load_prompts
    from divergence_probe.stacks.hooks import HookSet
    from divergence_probe.taps import parse_tap_selection

    prompts = load_prompts(prompts_file, hf_probe.tokenizer, max_model_len=hf_probe.settings.max_model_len)
    stack, installs = hf_probe.train, []
    real_after = HookSet.after
    monkeypatch.setattr(HookSet, "after", lambda self, m, fn: (installs.append(m), real_after(self, m, fn)))
    events = []
    sink = lambda pid, key, x: events.append(("tap", pid, key.name, x.shape[0]))  # noqa: E731
    returned = stack.score(prompts, parse_tap_selection("resid_out"), sink,
                           on_scored=lambda s: events.append(("scored", s.prompt_id, s.logits.shape[0])))
    assert returned == [] and len(installs) == stack.model.config.num_hidden_layers
    layers = stack.model.config.num_hidden_layers
    want = []
    for p in prompts:
        want += [("tap", p.prompt_id, "resid_out", len(p.token_ids))] * layers
        want.append(("scored", p.prompt_id, len(p.token_ids) - 1))
    assert events == want
    assert not any(layer._forward_hooks for layer in stack.layers)


class _Tokens:
    def convert_ids_to_tokens(self, ids):
        return [f"t{i}" for i in ids]


def _pending(infer_logits, train_logits):
    prompt = Prompt(7, "p.txt#0", "", (3, 1, 4, 1))
    targets = torch.tensor(prompt.token_ids[1:])
    seq = ScoredSequence(prompt.prompt_id, prompt, infer_logits, token_logprobs(infer_logits, targets),
                         prompt.prompt_id, len(prompt.token_ids))
    return PendingScores(_Tokens(), seq, train_logits, token_logprobs(train_logits, targets))


def test_pending_scores_carry_the_float32_logprobs_exactly():
    """Scores travel to the host as one float64 tensor: each logprob must come out as its float32 value."""
    g = torch.Generator().manual_seed(0)
    infer, train = torch.randn(3, 8, generator=g).bfloat16(), torch.randn(3, 8, generator=g).bfloat16()
    scores = _pending(infer, train).read()
    targets = torch.tensor([1, 4, 1])
    want_infer = torch.log_softmax(infer.float(), -1).gather(-1, targets[:, None])[:, 0].tolist()
    assert [s.logprob_infer for s in scores] == want_infer
    assert [s.position for s in scores] == [1, 2, 3] and [s.token for s in scores] == ["t1", "t4", "t1"]
    assert all(s.kl > 0 for s in scores)


def test_pending_scores_refuse_non_finite_logits_naming_the_side():
    good = torch.zeros(3, 8)
    bad = good.clone()
    bad[1, 2] = float("inf")
    with pytest.raises(NumericsError, match="the training stack produced NaN/Inf logits on prompt 7"):
        _pending(good, bad).read()
