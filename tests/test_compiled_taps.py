"""Layer taps under a compiled vLLM engine: the tap points change nothing the engine computes, and what they capture is
what the compiled graph computed.

One engine per process: each model runs twice in subprocesses sharing one fresh vLLM cache root, first with tap points
(`taps="all"`), then without (vLLM as deployed). The neutral tap set depends on Inductor's fusion decisions, so it is
checked per architecture (Qwen2: no q/k norm; Qwen3: q/k norm fused into RoPE).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from divergence_probe.errors import ProbeError

REPO = Path(__file__).resolve().parents[1]

# In the engine's process. With tap points: a compare with every tap, the raw taps of one scoring call, the taps of
# a generate-mode run, the manifest's tap status and the one-line errors. Without: the same compare, logprobs only.
ENGINE = r'''
import json, sys, torch
import divergence_probe as dp
from divergence_probe.errors import ProbeError
from divergence_probe.prompts import load_prompts
from divergence_probe.stacks import compiled_taps

model, prompts_file, out, taps = sys.argv[1:5]
probe = dp.load(model, infer="vllm", dtype="bfloat16", device="cpu", engine="compiled", taps=taps)
run = probe.compare(prompts=prompts_file, taps=taps)
result = {"logprobs": run.tokens_table[["prompt_id", "position", "logprob_infer"]].values.tolist(),
          "layers": sorted(set(run.layers_table.tap)), "taps": run.manifest["stacks"]["infer"]["settings"]["taps"],
          "not_captured": run.manifest["compare"].get("taps_not_captured", {}), "op_defined": compiled_taps._LIB is not None}
if taps != "none":
    prompts = load_prompts(prompts_file, probe.tokenizer, max_model_len=probe.settings.max_model_len)
    captured = {}
    probe.infer.score(prompts, frozenset(compiled_taps.NEUTRAL + compiled_taps.OUTSIDE),
                      lambda pid, key, x: captured.__setitem__((pid, key.name, key.layer), x.clone()))
    model_ = probe.infer.model.model
    norms = {("input_norm", i): layer.input_layernorm for i, layer in enumerate(model_.layers)}
    norms |= {("post_norm", i): layer.post_attention_layernorm for i, layer in enumerate(model_.layers)}
    norms[("final_norm", len(model_.layers))] = model_.norm
    torch.save({"taps": captured, "num_layers": len(model_.layers),
                "norms": {k: (m.weight.detach().clone(), m.variance_epsilon) for k, m in norms.items()}}, out + ".pt")
    try:
        probe.compare(prompts=prompts_file, taps="resid_out")
    except ProbeError as e:
        result["explicit_error"] = str(e)
    gen = probe.compare(prompts=prompts_file, taps="all", generate=dict(max_new_tokens=4, samples_per_prompt=1))
    result["generate_layers"] = sorted(set(gen.layers_table.tap))
json.dump(result, open(out, "w"))
'''


def _engine(model: Path, prompts: Path, out: Path, taps: str, cache_root: Path) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_CACHE_ROOT": str(cache_root)}
    proc = subprocess.run([sys.executable, "-c", ENGINE, str(model), str(prompts), str(out), taps],
                          capture_output=True, text=True, cwd=REPO, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module", params=["qwen2_tiny", "qwen3_tiny"])
def engines(request, prompts_file, tmp_path_factory) -> dict:
    model = request.getfixturevalue(request.param)
    folder = tmp_path_factory.mktemp(f"ctaps_{request.param}")
    cache_root = folder / "vllm_cache"
    tapped = _engine(model, prompts_file, folder / "tapped.json", "all", cache_root)
    artifacts_after_tapped = sorted(str(p.relative_to(cache_root)) for p in cache_root.rglob("*") if p.is_file())
    plain = _engine(model, prompts_file, folder / "plain.json", "none", cache_root)
    return {"tapped": tapped, "plain": plain, "raw": torch.load(folder / "tapped.json.pt"), "model": request.param,
            "artifacts_after_tapped": artifacts_after_tapped}


def test_tap_points_leave_the_logprobs_bitwise_equal(engines):
    tapped, plain = engines["tapped"], engines["plain"]
    assert not plain["op_defined"] and tapped["op_defined"]  # the plain engine is vLLM as deployed: no op, no hooks
    assert len(tapped["logprobs"]) > 0
    assert tapped["logprobs"] == plain["logprobs"]  # floats through JSON round-trip exactly


def test_taps_all_captures_the_neutral_set_and_lists_the_rest(engines):
    from divergence_probe.stacks import compiled_taps

    tapped = engines["tapped"]
    expected = set(compiled_taps.NEUTRAL) | set(compiled_taps.OUTSIDE)
    assert set(tapped["layers"]) == expected
    assert set(tapped["generate_layers"]) == expected
    refused = {"resid_mid", "resid_out"} | ({"q_norm", "k_norm"} if engines["model"] == "qwen3_tiny" else set())
    assert refused <= set(tapped["not_captured"]) <= set(compiled_taps.REFUSED)
    assert all(tapped["taps"][name] == "captured" for name in expected)
    assert "FP32" in tapped["not_captured"]["resid_out"]
    message = tapped["explicit_error"]
    assert "resid_out" in message and "--engine eager" in message and "\n" not in message
    plain = engines["plain"]  # an engine built without tap points says so for each layer tap
    assert plain["taps"]["swiglu"] == compiled_taps.NO_TAP_POINTS and plain["taps"]["logits"] == "captured"


def test_tapped_build_leaves_no_compile_artifact(engines):
    """vLLM's compile-cache keys do not see the hooks: a tapped build must neither save nor load an artifact."""
    assert not [p for p in engines["artifacts_after_tapped"] if "torch_compile_cache" in p]


def _inductor_row_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim in the order of Inductor's vectorised CPU reduction: one accumulator vector of the ISA's
    width added chunk by chunk along the row, then its lanes added as a tree of halves (`vec_reduce_all`). torch's
    own sum adds in another order, which moves a few last bits (1 element in 92,160 on the tiny Qwen2)."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    width = pick_vec_isa().nelements(torch.float) or 1
    chunks = x.reshape(*x.shape[:-1], -1, width).unbind(-2)
    total = chunks[0]
    for chunk in chunks[1:]:
        total = total + chunk
    while total.shape[-1] > 1:
        half = total.shape[-1] // 2
        total = total[..., :half] + total[..., half:]
    return total


def test_taps_are_what_the_graph_computed(engines):
    """Every RMSNorm tap (input_norm, post_norm of each layer, final_norm) equals the norm of the FP32 residual stream
    summed from the embed, attn_out and mlp_out taps, left to right, with one BF16 rounding at the end: what Inductor
    compiles. So the taps hold the graph's buffers of this very step, row-aligned per prompt; a tap of another
    layer, position or prompt, or one rounded to BF16 in the stream (eager semantics), breaks it."""
    raw = engines["raw"]
    taps, layers = raw["taps"], raw["num_layers"]
    prompts = sorted({pid for pid, _, _ in taps})
    assert prompts
    checked = 0
    for pid in prompts:
        stream = taps[(pid, "embed", -1)].float()
        for i in range(layers + 1):
            name = "final_norm" if i == layers else "input_norm"
            points = [(name, i, None)] if i == layers else [("input_norm", i, "attn_out"), ("post_norm", i, "mlp_out")]
            for norm, layer, then in points:
                weight, eps = raw["norms"][(norm, layer)]
                mean_square = _inductor_row_sum(stream * stream) / stream.shape[-1]
                expected = stream * torch.rsqrt(mean_square + eps) * weight.float()
                got = taps[(pid, norm, layer)]
                assert torch.equal(got, expected.to(got.dtype)), f"{norm}@{layer} prompt {pid}"
                checked += 1
                if then is not None:
                    stream = stream + taps[(pid, then, layer)].float()
    assert checked == len(prompts) * (2 * layers + 1)


def test_effectful_op_survives_compile():
    """Pins the private effect registration: an op that returns nothing, called in a compiled function whose result
    does not use it, must still run (not be removed as dead code), once per call, with the graph's value."""
    from divergence_probe.stacks import compiled_taps
    from divergence_probe.taps import TapKey

    compiled_taps.register_op()
    key = compiled_taps._key("swiglu", 0)
    seen = []

    def f(x):
        y = torch.nn.functional.silu(x) * 2
        torch.ops.dp.tap(y, key)
        return x + 1

    compiled = torch.compile(f, backend="inductor", fullgraph=True)
    x = torch.randn(4, 8)
    # Inductor's and AOTAutograd's caches key the graph, not the op's effect registration: a graph compiled once
    # without the effect (op dropped) would be served again, so this compile must not read them
    with torch._inductor.config.patch(force_disable_caches=True):
        compiled(x)  # no capture active: ignored
        compiled_taps._ACTIVE = compiled_taps.router(lambda k, t: seen.append((k, t)), frozenset({"swiglu"}))
        try:
            compiled(x)
        finally:
            compiled_taps._ACTIVE = None
    assert len(seen) == 1 and seen[0][0] == TapKey.of("swiglu", 0)
    assert torch.equal(seen[0][1], torch.nn.functional.silu(x) * 2)


@pytest.mark.parametrize("args, device, words", [
    ({}, "cuda", "cudagraph_mode"),
    ({"compilation_config": {"cudagraph_mode": "FULL_AND_PIECEWISE"}}, "cuda", "--engine eager"),
])
def test_cuda_graphs_refuse_layer_taps(args, device, words):
    from divergence_probe.stacks import compiled_taps

    with pytest.raises(ProbeError) as e:
        compiled_taps.check_cudagraphs(args, device)
    assert words in str(e.value) and "\n" not in str(e.value) and '"NONE"' in str(e.value)
    compiled_taps.check_cudagraphs({"compilation_config": {"cudagraph_mode": "NONE"}}, "cuda")
    compiled_taps.check_cudagraphs({}, "cpu")


def test_spec_refuses_only_the_perturbing_taps_under_compile():
    from divergence_probe.spec import CaptureSpec, LoadSpec, RunSpec

    compiled = LoadSpec(engine="compiled")
    RunSpec(load=compiled, capture=CaptureSpec(taps="swiglu,q_rope,embed,logits"))
    RunSpec(load=compiled, capture=CaptureSpec(taps="all"))
    for name in ("resid_mid", "q_norm"):
        with pytest.raises(ProbeError) as e:
            RunSpec(load=compiled, capture=CaptureSpec(taps=f"swiglu,{name}"))
        assert name in str(e.value) and "--engine eager" in str(e.value) and "\n" not in str(e.value)


def test_tap_points_are_part_of_the_engine_key():
    """One engine per process: an engine with tap points is another engine than vLLM as deployed, never reused for it
    (nor the reverse); eager engines need no tap points, whatever was asked."""
    from dataclasses import replace

    from divergence_probe.stacks.base import StackSettings
    from divergence_probe.stacks.compiled_taps import wants_tap_points
    from divergence_probe.stacks.vllm import _engine_key
    from divergence_probe.taps import parse_tap_selection

    compiled = StackSettings(model_path="m", dtype=torch.bfloat16, device="cpu", engine="compiled")
    assert _engine_key(compiled) != _engine_key(replace(compiled, engine_taps=True))
    eager = replace(compiled, engine="eager")
    assert _engine_key(eager) == _engine_key(replace(eager, engine_taps=True))
    assert wants_tap_points(parse_tap_selection("all")) and wants_tap_points(parse_tap_selection("swiglu"))
    assert not wants_tap_points(parse_tap_selection("final_norm,logits"))


def test_taps_all_under_cuda_graphs_builds_vllm_as_deployed_and_named_taps_are_refused():
    """--taps all (the default) takes what the engine can give: under CUDA graphs no tap points (the status then
    names the reason per tap); a layer tap named on its own must be captured, so CUDA graphs are refused for it."""
    from divergence_probe.stacks import compiled_taps
    from divergence_probe.stacks.base import StackSettings, freeze_engine_args

    def settings(device, args=None):
        return StackSettings(model_path="m", dtype=torch.bfloat16, device=device, engine="compiled",
                             engine_args=freeze_engine_args(args or {}))

    none = {"compilation_config": {"cudagraph_mode": "NONE"}}
    assert compiled_taps.tap_points_for("all", settings("cuda")) is False
    assert compiled_taps.tap_points_for("all", settings("cuda", none)) is True
    assert compiled_taps.tap_points_for("all", settings("cpu")) is True
    assert compiled_taps.tap_points_for("logits", settings("cuda")) is False
    assert compiled_taps.tap_points_for(None, settings("cpu")) is False
    with pytest.raises(ProbeError, match="cudagraph_mode"):
        compiled_taps.tap_points_for("input_norm,logits", settings("cuda"))
    assert compiled_taps.status(taps_built=False, cuda_graphs=True)["input_norm"] == compiled_taps.CUDA_GRAPHS


def test_engine_noise_checks_tap_points_against_an_engine_without_them(monkeypatch):
    """--engine-noise on a compiled engine with tap points scores a second engine: the same settings without tap
    points, and the summary carries its gap (0 when the tap points are numerically invisible)."""
    import types

    import pandas as pd

    from divergence_probe import batch_invariance
    from divergence_probe.compare import noise_floor_columns
    from divergence_probe.stacks.base import StackSettings

    built = []

    def fake_row(probe, sequences, other, regions, change):
        built.append((other.engine, other.engine_taps, change))
        return pd.DataFrame([{"stack": "vllm", "side": "infer", "change": change, "mean_abs_dlogp": 0.25 * len(built),
                              "max_abs_dlogp": 1.0, "mean_kl": 0.0, "max_kl": 0.0, "n_tokens": 3}])

    monkeypatch.setattr(batch_invariance, "_engine_row", fake_row)
    settings = StackSettings(model_path="m", dtype=torch.bfloat16, device="cpu", engine="compiled", engine_taps=True)
    table = batch_invariance.engine_noise(types.SimpleNamespace(settings=settings), [])
    assert [(engine, taps) for engine, taps, _ in built] == [("eager", False), ("compiled", False)]
    columns = noise_floor_columns(None, None, table)
    assert columns == {"noise_infer_engine_mode_mean_abs_dlogp": 0.25, "tap_points_mean_abs_dlogp": 0.5}
    built.clear()
    untapped = batch_invariance.engine_noise(types.SimpleNamespace(settings=StackSettings(
        model_path="m", dtype=torch.bfloat16, device="cpu", engine="compiled")), [])
    assert len(untapped) == 1 and "tap_points_mean_abs_dlogp" not in noise_floor_columns(None, None, untapped)
