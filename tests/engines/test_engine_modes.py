"""Engine modes and process state: vLLM compiled as deployed, engine args, and a trainer with its own torch state.

vLLM's CPU backend hosts one engine per process, so the compiled engine runs in one subprocess (`compiled_run`)
that does every in-engine check and reports JSON; a second, fresh process that never imports vLLM runs plain
transformers on the same ids, for the bitwise check of the training column.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from divergence_probe.engines import torch_state
from divergence_probe.errors import StackError
from divergence_probe.engines.protocol import StackSettings, freeze_engine_args

pytestmark = pytest.mark.engine  # every test here starts an engine or runs the tool in a child

REPO = Path(__file__).resolve().parents[2]
# the tokenizer loaded (RL frameworks load it), prefix caching left at vLLM's default (on): the same prompts are
# scored several times below, so a prompt token served from the cache would break the capture
ENGINE_ARGS = {"max_num_seqs": 16, "compilation_config": {"mode": 2}, "skip_tokenizer_init": False}

# In the compiled engine's process: every check that needs the engine, results to a JSON file. The trainer column is
# computed after the process's torch state was perturbed as vLLM perturbs it on CUDA (cuDNN SDPA off there; here the
# CPU's flash SDPA off, and one thread), so it can only match a fresh process if the trainer really is isolated.
IN_ENGINE = r'''
import json, sys, torch
from pathlib import Path
import divergence_probe as dp
from divergence_probe.engines import torch_state
from divergence_probe.prompts import load_prompts
from divergence_probe.errors import ProbeError

model, prompts_file, out, engine_args = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
result = {}
probe = dp.load(model, infer="vllm", dtype="bfloat16", device="cpu", engine="compiled", engine_args=engine_args)

def error_of(fn):
    try:
        fn()
    except ProbeError as e:
        return str(e)
    return None

for taps in ("none", "logits", "final_norm,logits"):
    run = probe.compare(prompts=prompts_file, taps=taps)
    result[f"prefill_{taps}"] = {"n_tokens": len(run.tokens_table), "layers": sorted(set(run.layers_table.tap)),
                                 "max_abs_dlogp": float(run.tokens_table.delta_logprob.abs().max()),
                                 "logprobs": run.tokens_table[["logprob_infer", "logprob_train", "kl"]].values.tolist()}
long = Path(out).with_name("long.txt")  # several KV blocks long, so a second pass could be served from the cache
long.write_text(" ".join(f"Sentence {i} of a prompt long enough to fill whole cache blocks." for i in range(30)))
result["prefix_cached_rows"] = [len(probe.compare(prompts=long, taps="logits", max_prompt_tokens=1500).tokens_table) for _ in range(2)]
result["block_size"] = probe.infer.llm.llm_engine.vllm_config.cache_config.block_size
result["layer_tap_error"] = error_of(lambda: probe.compare(prompts=prompts_file, taps="resid_out"))
every = probe.compare(prompts=prompts_file, taps="all")
result["all_taps"] = {"layers": sorted(set(every.layers_table.tap)),
                      "not_captured": sorted(every.manifest["compare"].get("taps_not_captured", {}))}
gen = probe.compare(prompts=prompts_file, taps="logits", generate=dict(max_new_tokens=6, samples_per_prompt=2))
result["generate"] = {"n_response": int(gen.tokens_table.is_response.sum()), "n_tokens": len(gen.tokens_table)}
# the prompt's KV blocks are in the prefix cache when the prefill pass of logprob_prefill scores prompt+response
split = probe.compare(prompts=long, taps="none", max_prompt_tokens=1500, generate=dict(max_new_tokens=4, samples_per_prompt=2))
t = split.tokens_table
r = t[t.is_response]
result["generate_split"] = {
    "rows": len(t), "prefilled_rows": int(t.logprob_prefill.notna().sum()),
    "exact": bool(((((r.logprob_train - r.logprob_prefill) + (r.logprob_prefill - r.logprob_infer)) + 0.0)
                   == r.delta_logprob).all()),
    "summary": {k: v for k, v in split.summary.items() if "_vs_" in k or k == "dominant_factor"}}
result["align_train_rows"] = len(probe.compare(prompts=prompts_file, taps="none", align="rope", side="train").tokens_table)
manifest = probe.compare(prompts=prompts_file, taps="none").manifest
result["infer_settings"] = manifest["stacks"]["infer"]["settings"]
from dataclasses import replace
from divergence_probe.engines.vllm.stack import VLLMStack
result["other_engine_error"] = error_of(lambda: VLLMStack().load(replace(probe.settings, engine="eager")))
VLLMStack().load(replace(probe.settings, train_sdpa="math", train_attn="eager"))  # the same engine: reused

prompts = load_prompts(prompts_file, probe.tokenizer, max_model_len=probe.settings.max_model_len)
torch.backends.cuda.enable_flash_sdp(False)  # what vLLM's import does to cuDNN SDPA on CUDA, on the CPU's kernel
torch._C.set_num_threads(1)                  # what vLLM's CUDA worker does to torch's threads
perturbed = torch_state.capture()
scores = probe.train.score(prompts, frozenset(), lambda *a: None)
result["state_restored"] = torch_state.capture() == perturbed
result["train_settings"] = probe.train.info().settings
torch.save({"ids": [p.token_ids for p in prompts], "logits": [s.logits for s in scores]}, out + ".pt")
# last, for it fails mid-step: a prefill pass allowed to read the prefix cache (which the tool never allows) is refused
from vllm import SamplingParams
own_params = VLLMStack._params
VLLMStack._params = lambda self, **kw: (SamplingParams(**kw, skip_reading_prefix_cache=False) if kw.get("max_tokens") == 1
                                        else own_params(self, **kw))
result["prefill_from_cache_error"] = error_of(lambda: probe.compare(
    prompts=long, taps="none", max_prompt_tokens=1500, generate=dict(max_new_tokens=4, samples_per_prompt=2)))
json.dump(result, open(out, "w"), default=str)
'''

# A trainer process: plain transformers, never vLLM.
FRESH = r'''
import sys, torch
from transformers import AutoModelForCausalLM
model_path, data, out = sys.argv[1:4]
model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
logits = []
with torch.inference_mode():
    for ids in torch.load(data)["ids"]:
        ids = torch.tensor([ids])
        logits.append(model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None], use_cache=False).logits[0, :-1])
torch.save({"logits": logits, "vllm_imported": "vllm" in sys.modules}, out)
'''


def _run(script: str, *args: str, timeout: int = 900) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, cwd=REPO,
                          timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.fixture(scope="module")
def compiled_run(qwen3_tiny, prompts_file, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("compiled") / "result.json"
    _run(IN_ENGINE, str(qwen3_tiny), str(prompts_file), str(out), json.dumps(ENGINE_ARGS))
    return json.loads(out.read_text()) | {"_path": str(out)}


def test_compiled_prefill_scores_with_logits_and_final_norm(compiled_run):
    for taps in ("none", "logits", "final_norm,logits"):
        run = compiled_run[f"prefill_{taps}"]
        assert run["n_tokens"] > 0
    assert compiled_run["prefill_logits"]["layers"] == ["logits"]
    assert compiled_run["prefill_final_norm,logits"]["layers"] == ["final_norm", "logits"]
    settings = compiled_run["infer_settings"]
    # the captured logits reproduce vLLM's own reported logprobs exactly, outside the compiled graph
    assert settings["captured_logits_vs_reported_logprobs_max_gap"] == 0.0
    assert settings["compilation"]["mode"] != "NONE" and settings["enforce_eager"] is False


def test_compiled_taps_on_or_off_leave_the_logprobs_bitwise_equal(compiled_run):
    none = compiled_run["prefill_none"]["logprobs"]
    assert none == compiled_run["prefill_logits"]["logprobs"] == compiled_run["prefill_final_norm,logits"]["logprobs"]


def test_compiled_layer_taps_refused_and_reported(compiled_run):
    message = compiled_run["layer_tap_error"]  # named explicitly: an error
    assert message and "\n" not in message and "--engine eager" in message
    every = compiled_run["all_taps"]  # --taps all: every tap that crosses the graph, the rest listed as not captured
    assert every["layers"] == ["embed", "final_norm", "logits"]  # taken outside the graph: no tap points needed
    assert "resid_out" in every["not_captured"] and "logits" not in every["not_captured"]
    taps = compiled_run["infer_settings"]["taps"]
    assert taps["logits"] == taps["final_norm"] == taps["embed"] == "captured"
    assert all(v.startswith("not captured") for k, v in taps.items() if k not in ("logits", "final_norm", "embed"))


def test_compiled_generate_mode(compiled_run):
    assert compiled_run["generate"]["n_response"] > 0


def test_compiled_generate_mode_splits_the_ratio_with_the_prefix_cache_on(compiled_run):
    """The prefill pass of logprob_prefill scores every token of every sampled sequence although the decode left the
    prompt's KV blocks in the prefix cache (a pass made to read the cache leaves its step short, which the capture
    refuses), and the three log-factors add up to delta_logprob to the bit on the compiled engine too."""
    split = compiled_run["generate_split"]
    assert split["prefilled_rows"] == split["rows"] > 3 * compiled_run["block_size"]
    assert split["exact"]
    s = split["summary"]
    assert "decode_vs_recorded_mean_abs_dlogp" not in s and s["train_vs_prefill_mean_abs_dlogp"] > 0
    assert s["dominant_factor"] in ("train_vs_prefill", "prefill_vs_decode")
    # had the pass read the cached prefix, its steps would miss rows: refused in one line, not a factor of 1
    assert "match no submitted prompt" in compiled_run["prefill_from_cache_error"]


def test_engine_args_round_trip_into_manifest(compiled_run):
    settings = compiled_run["infer_settings"]
    assert settings["engine"] == "compiled"
    assert settings["engine_args"] == ENGINE_ARGS  # verbatim
    assert settings["max_num_seqs"] == ENGINE_ARGS["max_num_seqs"]  # and in effect, read back from the engine
    assert settings["enable_prefix_caching"] is True  # vLLM's default


def test_prefix_caching_never_serves_a_scored_prompt(compiled_run):
    """With prefix caching on, the same long prompt scored twice: the second pass computes every token again."""
    first, second = compiled_run["prefix_cached_rows"]
    assert first == second > 2 * compiled_run["block_size"]


def test_one_engine_per_process_keyed_by_engine_mode(compiled_run):
    message = compiled_run["other_engine_error"]
    assert message and "engine mode" in message and "\n" not in message


def test_train_side_alignment_against_the_compiled_engine(compiled_run):
    assert compiled_run["align_train_rows"] > 0  # engine-side alignment in compiled mode: test_compiled_align.py


def test_isolated_trainer_equals_a_fresh_process_bitwise(compiled_run, qwen3_tiny, tmp_path):
    assert compiled_run["state_restored"]  # the engine's (perturbed) state is back after the training forward
    train = compiled_run["train_settings"]
    assert train["torch_numerics"]["sdp.flash_enabled"] is True and "before vllm" in train["torch_numerics_snapshot"]
    assert train["sdpa_kernel_chosen"]["score"] == ["flash_attention"]
    data = compiled_run["_path"] + ".pt"
    fresh = tmp_path / "fresh.pt"
    _run(FRESH, str(qwen3_tiny), data, str(fresh))
    ours, theirs = torch.load(data)["logits"], torch.load(fresh)
    assert not theirs["vllm_imported"]
    assert len(ours) == len(theirs["logits"])
    for a, b in zip(ours, theirs["logits"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("args, engine, words", [
    ({"max_num_seqz": 4}, "compiled", "max_num_seqs"),  # unknown: names the nearest keyword
    ({"pipeline_parallel_size": 2}, "compiled", "use 1"),
    ({"tensor_parallel_size": "2"}, "eager", "whole number"),
    ({"tensor_parallel_size": 2, "distributed_executor_backend": "ray"}, "eager", "'mp'"),
    ({"dtype": "float16"}, "compiled", "--dtype"),
    ({"enforce_eager": True}, "compiled", "--engine"),
    ({"logprobs_mode": "processed_logits"}, "compiled", "raw logprobs"),
    ({"compilation_config": {"mode": 3}}, "eager", "--engine compiled"),
    ({"compilation_config": {"no_such_field": 1}}, "compiled", "compilation config"),
])
def test_bad_engine_args_are_one_line_errors(args, engine, words):
    from divergence_probe.engines.vllm.args import check_engine_args

    with pytest.raises(StackError) as e:
        check_engine_args(args, engine)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_good_engine_args_pass():
    from divergence_probe.engines.vllm.args import check_engine_args

    check_engine_args({"enable_prefix_caching": True, "enable_chunked_prefill": True, "max_num_seqs": 8,
                       "compilation_config": {"mode": 3, "cudagraph_mode": "PIECEWISE"}}, "compiled")
    check_engine_args({}, "eager")


def test_engine_args_are_hashable_and_thaw_verbatim():
    settings = StackSettings(model_path="m", dtype=torch.bfloat16, device="cpu",
                             engine_args=freeze_engine_args(ENGINE_ARGS | {"x": [1, {"y": 2}]}))
    hash(settings)
    assert settings.engine_kwargs() == ENGINE_ARGS | {"x": [1, {"y": 2}]}


def test_trainer_numerics_switch_and_restore():
    engine = torch_state.capture()
    trainer = torch_state.trainer_state()
    try:
        torch.backends.cuda.enable_flash_sdp(not trainer["sdp.flash_enabled"])
        torch.set_float32_matmul_precision("medium")
        perturbed = torch_state.capture()
        with torch_state.trainer_numerics("math"):
            assert torch.get_float32_matmul_precision() == trainer["float32_matmul_precision"]
            q = torch.randn(1, 2, 5, 8)
            assert torch_state.sdpa_choice(q, q, q, is_causal=True) == "math"
        assert torch_state.capture() == perturbed
    finally:
        torch_state.apply(engine)


def test_train_sdpa_that_cannot_take_effect_is_an_error():
    for backend, attn, words in [("efficient", "sdpa", "no CPU kernel"), ("math", "eager", "--train-attn sdpa"),
                                 ("fast", "sdpa", "choose one of")]:
        with pytest.raises(StackError, match=words):
            torch_state.check_sdpa(backend, "cpu", attn)
