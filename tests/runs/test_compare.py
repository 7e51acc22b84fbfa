"""compare through the Python API, against the real vLLM engine and real transformers (tiny Qwen3)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from divergence_probe.runs.compare import PendingScores, ScoredSequence
from divergence_probe.errors import NumericsError, StackError
from divergence_probe.numerics.metrics import token_logprobs
from divergence_probe.models import get_family
from divergence_probe.prompts import Prompt
from divergence_probe.taps import ALL_TAPS, expected_taps

pytestmark = pytest.mark.engine  # every test here starts an engine or runs the tool in a child

QWEN2_TAPS, QWEN3_TAPS = get_family("qwen2").layer_taps, get_family("qwen3").layer_taps


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
    want = {(k.name, k.layer) for k in expected_taps(frozenset(ALL_TAPS), n_layers, layer_taps=QWEN3_TAPS)}
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


def _nudged(reported: torch.Tensor, position: int, steps: int, spacing: float) -> torch.Tensor:
    out = reported.clone()
    out[position] = float(reported[position]) - steps * spacing  # exact: a multiple of the value's own spacing
    return out


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_captured_logits_must_reproduce_reported_logprobs_within_the_documented_bound(device):
    """engines/vllm/stack.py checks the captured logits against vLLM's reported logprobs: on the CPU not one ULP may differ;
    on a GPU up to 4 float32 ULPs of the larger of |logit| and |logsumexp| (the bound justified there), no more."""

    from divergence_probe.engines.vllm.stack import VLLMStack

    stack = VLLMStack()
    stack.settings = SimpleNamespace(device=device)  # the check reads only the device (tensors stay on the CPU)
    g = torch.Generator().manual_seed(0)
    logits = (20 + 2 * torch.randn(6, 500, generator=g)).bfloat16()  # logit and logsumexp > 0: |logprob| is smaller
    tokens = [0, 7, 42, 99, 3, 250, 499]
    exact = logits.log_softmax(-1, dtype=torch.float32)[torch.arange(6), torch.tensor(tokens[1:])]
    lse = torch.logsumexp(logits.double(), -1)
    spacing = float(np.spacing(np.float32(lse[3].item())))  # float32 ULP of the larger term (logsumexp) at row 3

    stack._check_logits(logits, tokens, exact, "prompt 0")
    assert stack.recompute_gap == 0.0
    allowed = 0 if device == "cpu" else 4
    if allowed:
        stack._check_logits(logits, tokens, _nudged(exact, 3, allowed, spacing), "prompt 0")
        assert stack.recompute_gap == allowed * spacing  # recorded for the manifest
    with pytest.raises(StackError, match="prompt 0 do not reproduce vLLM's own logprobs .* at position 4"):
        stack._check_logits(logits, tokens, _nudged(exact, 3, allowed + 1, spacing), "prompt 0")


def test_taps_do_not_change_logprobs(vllm_probe, prompts_file):
    tapped = vllm_probe.compare(prompts=prompts_file, taps="all").tokens_table
    untapped = vllm_probe.compare(prompts=prompts_file, taps="none").tokens_table
    assert tapped.equals(untapped)


def test_taps_kept_without_a_clone_are_never_written_again(vllm_probe, prompts_file, monkeypatch):
    """vLLM's taps are cloned only where vLLM may overwrite the buffer later (step.REWRITTEN): with every tap
    cloned, every statistic is the same. A tap wrongly left out of REWRITTEN is paired after vLLM overwrote it
    (on this CPU build: q_norm and k_norm, which RoPE rotates in place; its fused add+norm is out of place)."""
    from divergence_probe.engines.vllm import step as vllm_step
    from divergence_probe.taps import ALL_TAPS

    selective = vllm_probe.compare(prompts=prompts_file, taps="all").layers_table
    monkeypatch.setattr(vllm_step, "REWRITTEN", frozenset(ALL_TAPS))
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
    """Pairing taps across inference batches of different sizes (all prompts in one engine step, or one prompt
    per step) gives the same per-tap aggregates and token scores, bit for bit."""
    one_batch = vllm_probe.compare(prompts=prompts_file, taps="resid_out,logits")
    small = dataclasses.replace(vllm_probe, settings=dataclasses.replace(vllm_probe.settings, batch_tokens=1))
    per_prompt = small.compare(prompts=prompts_file, taps="resid_out,logits")
    assert len(one_batch.layers_table) == vllm_probe.source.num_layers + 1
    assert per_prompt.layers_table.equals(one_batch.layers_table)
    assert per_prompt.tokens_table.equals(one_batch.tokens_table)


def test_training_stack_captures_a_batch_under_one_set_of_hooks(hf_probe, prompts_file, monkeypatch):
    """Hooks are installed once per score call, every tap is filed under the prompt that made it, each prompt's
    scores arrive (in order) before the next prompt runs, and no hook outlives the call."""
    from divergence_probe.prompts import load_prompts
    from divergence_probe.engines.hooks import HookSet
    from divergence_probe.tap_selection import parse_tap_selection

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


def test_training_projection_taps_are_the_projections_in_and_out_and_leave_nothing_behind(hf_probe):
    """The projections are captured by wrapping their forward (cheaper than module hooks): what they hand over is each
    projection's input and output; the wrappers are gone after the call, also when one of them could not be
    installed because another live patch holds that forward."""
    from divergence_probe.prompts import Prompt
    from divergence_probe.engines.hooks import HookSet, PatchConflict
    from divergence_probe.tap_selection import parse_tap_selection

    stack = hf_probe.train
    prompt = Prompt(0, "test", "", tuple(range(3, 14)))
    got = {}
    stack.score([prompt], parse_tap_selection("input_norm,q_proj,swiglu,mlp_out"),
                lambda pid, key, x: got.__setitem__((key.name, key.layer), x))
    layers = stack.layers
    with torch.inference_mode():
        for i, layer in enumerate(layers):
            assert torch.equal(got[("q_proj", i)], layer.self_attn.q_proj(got[("input_norm", i)]))
            assert torch.equal(got[("mlp_out", i)], layer.mlp.down_proj(got[("swiglu", i)]))
    modules = list(stack.model.modules())
    assert not any("forward" in vars(m) or m._forward_hooks or m._forward_pre_hooks for m in modules)
    held = layers[-1].mlp.down_proj
    with HookSet() as hooks:
        hooks.replace(held, "forward", held.forward, owner="another patch")
        with pytest.raises(PatchConflict, match="another patch and the projection taps"):
            stack.score([prompt], parse_tap_selection("all"), lambda *_: None)
        assert not any(("forward" in vars(m) and m is not held) or m._forward_hooks for m in modules)
    assert not any("forward" in vars(m) for m in modules)


def test_run_loop_callbacks_run_outside_the_sdpa_observer(hf_probe, prompts_file, monkeypatch):
    """The first score call records the SDPA kernel through a torch function mode; the run loop's callback (where
    taps are reduced by a compiled function, guarded on the mode stack) must not run under it, or the reduction
    compiles again in every later call."""
    from divergence_probe.prompts import load_prompts

    prompts = load_prompts(prompts_file, hf_probe.tokenizer, max_model_len=hf_probe.settings.max_model_len)[:2]
    stack = hf_probe.train
    monkeypatch.setattr(stack, "sdpa_chosen", {})  # as in a fresh process: this call is the observed one
    modes = []
    stack.score(prompts, frozenset(), lambda *_: None,
                on_scored=lambda s: modes.append(len(torch.overrides._get_current_function_mode_stack())))
    assert modes == [0, 0]
    assert stack.sdpa_chosen["score"]  # the forwards were observed


def test_run_loop_pauses_automatic_garbage_collection_and_restores_it(hf_probe, prompts_file, monkeypatch):
    import gc

    from divergence_probe.runs import compare

    seen, read = [], compare.PendingScores.read
    monkeypatch.setattr(compare.PendingScores, "read", lambda self: (seen.append(gc.isenabled()), read(self))[1])
    assert gc.isenabled()
    hf_probe.compare(prompts=prompts_file, taps="none", num_prompts=3)
    assert seen == [False, False, False] and gc.isenabled()


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


def test_side_infer_and_side_train_align_only_that_stack(vllm_probe, prompts_file):
    """--side infer patches the engine alone (the trainer's logprobs stay those of the shipped run, bit for bit),
    --side train the trainer alone."""
    shipped = vllm_probe.compare(prompts=prompts_file, taps="none").tokens_table
    for side, kept, moved in (("infer", "logprob_train", "logprob_infer"), ("train", "logprob_infer", "logprob_train")):
        run = vllm_probe.compare(prompts=prompts_file, taps="none", align="rope,swiglu,rmsnorm", side=side)
        assert run.manifest["align"] == {"regions": ["rope", "swiglu", "rmsnorm"], "side": side}
        assert run.tokens_table[kept].equals(shipped[kept]), side
        assert not run.tokens_table[moved].equals(shipped[moved]), side


def _abs_deltas(alone: list[list[float]], together: list[list[float]]) -> np.ndarray:
    return np.concatenate([np.abs(np.array(b, dtype=np.float64) - np.array(a, dtype=np.float64))
                           for a, b in zip(alone, together)])


def test_batch_invariance_values_equal_an_independent_recomputation(vllm_probe, qwen3_tiny, prompts_file):
    """The noise-floor rows hold what each stack does alone vs batched, recomputed here without the tool: vLLM's own
    prompt logprobs from one request per call and from all requests in one call; a fresh transformers model run on
    each prompt alone and on all of them right-padded in one forward with an attention mask."""
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    run = vllm_probe.compare(prompts=prompts_file, taps="none", batch_invariance=True)
    rows = run.batch_invariance.set_index("side")
    ids = [list(p.token_ids) for p in run.prompts]

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    llm = vllm_probe.infer.llm

    def vllm_logprobs(group):
        outs = llm.generate([TokensPrompt(prompt_token_ids=t) for t in group], params, use_tqdm=False)
        return [[e[tok].logprob for e, tok in zip(o.prompt_logprobs[1:], t[1:])] for o, t in zip(outs, group)]

    model = AutoModelForCausalLM.from_pretrained(qwen3_tiny, dtype=torch.bfloat16, attn_implementation="sdpa").eval()

    def hf_logprobs(logits, t):
        return torch.log_softmax(logits[: len(t) - 1].float(), -1).gather(-1, torch.tensor(t[1:])[:, None])[:, 0].tolist()

    with torch.inference_mode():
        hf_alone = [hf_logprobs(model(input_ids=torch.tensor([t])).logits[0], t) for t in ids]
        longest = max(map(len, ids))
        padded = torch.tensor([t + [0] * (longest - len(t)) for t in ids])
        mask = torch.tensor([[1] * len(t) + [0] * (longest - len(t)) for t in ids])
        batch_logits = model(input_ids=padded, attention_mask=mask).logits
        hf_together = [hf_logprobs(batch_logits[i], t) for i, t in enumerate(ids)]

    for side, alone, together in (("infer", [vllm_logprobs([t])[0] for t in ids], vllm_logprobs(ids)),
                                  ("train", hf_alone, hf_together)):
        d = _abs_deltas(alone, together)
        row = rows.loc[side]
        assert (row.n_tokens, row.batch_size) == (len(d), len(ids)), side
        assert row.mean_abs_dlogp == d.mean() and row.max_abs_dlogp == d.max(), (side, row.mean_abs_dlogp, d.mean())
    assert run.summary["noise_infer_mean_abs_dlogp"] == rows.loc["infer", "mean_abs_dlogp"]
    assert run.summary["noise_train_mean_abs_dlogp"] == rows.loc["train", "mean_abs_dlogp"]


def test_hf_noise_floor_rows_with_infer_hf_are_the_same_transformers_numbers(hf_probe, prompts_file):
    """With --infer hf both rows are transformers instances of the same checkpoint: the same alone-vs-batched
    difference on both sides, to the bit (not 0: a right-padded batch changes transformers' numbers on the CPU)."""
    floor = hf_probe.compare(prompts=prompts_file, taps="none", batch_invariance=True).batch_invariance
    infer, train = (floor[floor.side == s].drop(columns="side").reset_index(drop=True) for s in ("infer", "train"))
    assert infer.equals(train)
    assert infer.mean_abs_dlogp[0] > 0  # padding a batch does move transformers' logprobs: not an empty check


def test_kernel_noise_is_the_trainer_against_itself_under_another_sdpa_kernel(hf_probe, prompts_file):
    """--batch-invariance also scores the training side with the math SDPA kernel: the row holds exactly what a
    second transformers instance pinned to math gives against the first, and it is a real (nonzero) floor."""
    run = hf_probe.compare(prompts=prompts_file, taps="none", batch_invariance=True)
    row = run.kernel_noise.iloc[0]
    assert (row.side, row.change) == ("train", "sdpa math vs auto")
    math_probe = hf_probe.with_trainer(train_sdpa="math")
    try:
        d = np.concatenate([(math_probe.train.score([p], frozenset(), lambda *_: None)[0].logprobs.double()
                             - hf_probe.train.score([p], frozenset(), lambda *_: None)[0].logprobs.double()).abs().numpy()
                            for p in run.prompts])
    finally:
        math_probe.close()
    assert row.mean_abs_dlogp == d.mean() and row.max_abs_dlogp == d.max() and row.n_tokens == d.size
    assert row.mean_abs_dlogp > 0  # on this CPU torch picks its flash kernel for auto, which rounds differently
    assert run.summary["noise_train_kernel_mean_abs_dlogp"] == row.mean_abs_dlogp


def test_the_batch_and_kernel_floors_share_the_trainers_alone_pass(hf_probe, prompts_file, monkeypatch):
    """Both floors compare against the trainer's score of each sequence alone, which is the same forward: the run's
    own pass and one alone pass for the floors, not one per floor."""
    calls = []
    score = hf_probe.train.score

    def counted(prompts, *args, **kwargs):
        calls.append(len(prompts))
        return score(prompts, *args, **kwargs)

    monkeypatch.setattr(hf_probe.train, "score", counted)
    run = hf_probe.compare(prompts=prompts_file, taps="none", batch_invariance=True)
    assert run.kernel_noise is not None and sum(calls) == 2 * len(run.prompts)


def test_each_floor_is_summed_per_prompt_for_the_verdicts_resampling():
    """The floor tables carry each sequence's |Δlogp| sums beside their means, through a concatenation, and compare
    files them under the prompt each sequence came from: in generate mode a prompt's samples are one prompt."""
    import pandas as pd

    from divergence_probe.runs.batch_invariance import _change_row, concat_floors
    from divergence_probe.runs.compare import floor_prompt_table, noise_floor_columns, sequence_prompts
    from divergence_probe.runs.scored import TokenScore

    sequences = [Prompt(10 + i, f"s{i}", "", (1, 2, 3)) for i in range(3)]  # prompt 0 twice, then prompt 1
    tokens = [TokenScore(p, pos, 0, "", 0.0, 0.0, 0.0, sample_id=s)
              for p, s in ((0, 0), (0, 1), (1, 0)) for pos in (1, 2)]
    prompt_of = sequence_prompts(tokens, sequences, generate=True)
    assert prompt_of == {10: 0, 11: 0, 12: 1}
    deltas = [np.array([1.0, 3.0]), np.array([2.0, 2.0]), np.array([4.0, 8.0])]
    kls = [np.zeros(2)] * 3
    kernel = _change_row("hf", "train", "sdpa math vs auto", deltas, kls, sequences)
    parallel = _change_row("hf", "train", "train_tp 1 vs 2", [d / 2 for d in deltas], kls, sequences)
    both = concat_floors([kernel, parallel])
    table = floor_prompt_table(prompt_of, None, both).set_index(["floor", "prompt_id"])
    kernel_floor = table.loc["noise_train_kernel_mean_abs_dlogp"]
    assert kernel_floor.loc[0, "n"] == 4 and kernel_floor.loc[0, "sum_abs_dlogp"] == 8.0
    assert kernel_floor.loc[1, "sum_abs_dlogp"] == 12.0
    assert table.loc[("noise_train_tensor_parallel_mean_abs_dlogp", 1), "sum_abs_dlogp"] == 6.0
    # the per-prompt sums add up to the mean summary.csv holds
    columns = noise_floor_columns(None, both)
    assert kernel_floor["sum_abs_dlogp"].sum() / kernel_floor["n"].sum() == columns["noise_train_kernel_mean_abs_dlogp"]
    assert len(floor_prompt_table(prompt_of, None)) == 0 and isinstance(floor_prompt_table(prompt_of, None), pd.DataFrame)
    # an ablation stacks each combination's floor tables into one CSV: the sums they carry must not stop pandas
    stacked = pd.concat([kernel.assign(combo="none"), parallel.assign(combo="rope"), both.assign(combo="x")])
    assert len(stacked) == 4
