"""Layer taps under a compiled vLLM engine: the tap points change nothing the engine computes, and what they capture is
what the compiled graph computed.

One engine per process: each model runs twice in subprocesses sharing one fresh vLLM cache root, first with tap points
(`taps="all"`), then without (vLLM as deployed). The neutral tap set depends on Inductor's fusion decisions, so it is
checked per architecture (Qwen2: no q/k norm; Qwen3: q/k norm fused into RoPE; Qwen3-MoE: a router and experts in
place of the dense MLP, with the router's logits and choice as tap points).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from divergence_probe.errors import ProbeError

from divergence_probe.models import get_family

pytestmark = pytest.mark.engine  # every test here starts an engine or runs the tool in a child

REPO = Path(__file__).resolve().parents[3]

# In the engine's process. With tap points: a compare with every tap, the raw taps of one scoring call, the taps of
# a generate-mode run, the manifest's tap status and the one-line errors. Without: the same compare, logprobs only.
ENGINE = r'''
import json, sys, torch
import divergence_probe as dp
from divergence_probe.errors import ProbeError
from divergence_probe.prompts import load_prompts
from divergence_probe.engines.vllm import compiled_taps
from divergence_probe.taps import each_tap

def keep(into, name=lambda pid, key: (pid, key.name, key.layer)):  # a sink that keeps every tap on its own
    def sink(pid, tap, x):
        for key, rows in each_tap(tap, x):
            into[name(pid, key)] = rows.clone()
    return sink

model, prompts_file, out, taps = sys.argv[1:5]
probe = dp.load(model, infer="vllm", dtype="bfloat16", device="cpu", engine="compiled", taps=taps)
run = probe.compare(prompts=prompts_file, taps=taps)
result = {"logprobs": run.tokens_table[["prompt_id", "position", "logprob_infer"]].values.tolist(),
          "layers": sorted(set(run.layers_table.tap)), "taps": run.manifest["stacks"]["infer"]["settings"]["taps"],
          "not_captured": run.manifest["compare"].get("taps_not_captured", {}), "op_defined": compiled_taps._LIB is not None,
          "tap_buffer_bytes": run.manifest["stacks"]["infer"]["settings"]["tap_buffer_bytes"],
          "model_type": probe.source.family.model_type,
          "routes_checked": run.manifest["compare"].get("routing", {}).get("engine_routes_checked_token_layers"),
          "routed_rows": run.routing.table()["tokens"].tolist() if run.routing is not None else None}
if taps != "none":
    prompts = load_prompts(prompts_file, probe.tokenizer, max_model_len=probe.settings.max_model_len)
    captured = {}
    probe.infer.score(prompts, frozenset(compiled_taps.NEUTRAL + compiled_taps.ROUTER + compiled_taps.OUTSIDE),
                      keep(captured))
    model_ = probe.infer.model.model
    norms = {("input_norm", i): layer.input_layernorm for i, layer in enumerate(model_.layers)}
    norms |= {("post_norm", i): layer.post_attention_layernorm for i, layer in enumerate(model_.layers)}
    norms[("final_norm", len(model_.layers))] = model_.norm
    torch.save({"taps": captured, "num_layers": len(model_.layers), "config": probe.source.config,
                "norms": {k: (m.weight.detach().clone(), m.variance_epsilon) for k, m in norms.items()}}, out + ".pt")
    # consecutive steps through the static buffers: P, then Q (P's tokens reversed), then P again, each a scoring call
    # of its own; and a generate-mode call whose decode steps (one row per sequence) are read one by one
    import dataclasses
    from divergence_probe.engines.protocol import SamplingSpec
    wanted = frozenset({"embed", "mlp_out"})
    def scored(p):
        got = {}
        probe.infer.score([p], wanted, keep(got, lambda pid, key: (key.name, key.layer)))
        return {"ids": list(p.token_ids), "taps": got}
    p = prompts[0]
    q = dataclasses.replace(p, token_ids=tuple(reversed(p.token_ids)))
    steps = [scored(p), scored(q), scored(p)]
    gen_taps = {}
    seqs = probe.infer.sample(prompts[:2], SamplingSpec(max_new_tokens=5, temperature=1.0), frozenset({"embed"}),
                              keep(gen_taps, lambda sid, key: sid))
    torch.save({"steps": steps, "embedding": model_.embed_tokens.weight.detach().clone(),
                "generated": [(s.seq_id, list(s.token_ids), gen_taps[s.seq_id]) for s in seqs]}, out + ".steps.pt")
    try:
        probe.compare(prompts=prompts_file, taps="resid_out")
    except ProbeError as e:
        result["explicit_error"] = str(e)
    gen = probe.compare(prompts=prompts_file, taps="all", generate=dict(max_new_tokens=4, samples_per_prompt=1))
    result["generate_layers"] = sorted(set(gen.layers_table.tap))
json.dump(result, open(out, "w"))
'''


ARCHS = ("qwen2_tiny", "qwen3_tiny", "qwen3_moe_tiny")


def _engines(models: dict[str, Path], prompts: Path, folders: dict[str, Path], taps: str) -> dict[str, dict]:
    """One engine process per model, started together: a vLLM CPU engine serves on one thread, so on the CI's two
    cores the three builds overlap. Each model's processes share the vLLM cache root in its folder."""
    procs = {}
    for arch, model in models.items():
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               "VLLM_CACHE_ROOT": str(folders[arch] / "vllm_cache")}
        out = folders[arch] / f"{taps}.json"
        with open(f"{out}.stderr", "w") as err:  # a file, not a pipe: a full pipe would stall the process
            procs[arch] = (out, subprocess.Popen([sys.executable, "-c", ENGINE, str(model), str(prompts), str(out),
                                                  taps], stdout=subprocess.DEVNULL, stderr=err, cwd=REPO, env=env))
    results = {}
    for arch, (out, proc) in procs.items():
        proc.wait(timeout=1200)
        assert proc.returncode == 0, f"{arch} ({taps}):\n{Path(f'{out}.stderr').read_text()[-4000:]}"
        results[arch] = json.loads(out.read_text())
    return results


@pytest.fixture(scope="module")
def all_engines(prompts_file, tmp_path_factory, request) -> dict:
    """Every model built tapped (`taps="all"`), then plain (no tap points), into one fresh vLLM cache root each."""
    models = {arch: request.getfixturevalue(arch) for arch in ARCHS}
    folders = {arch: tmp_path_factory.mktemp(f"ctaps_{arch}") for arch in ARCHS}
    tapped = _engines(models, prompts_file, folders, "all")
    artifacts = {arch: sorted(str(p.relative_to(folders[arch] / "vllm_cache"))
                              for p in (folders[arch] / "vllm_cache").rglob("*") if p.is_file()) for arch in ARCHS}
    plain = _engines(models, prompts_file, folders, "none")
    return {arch: {"tapped": tapped[arch], "plain": plain[arch], "raw": torch.load(folders[arch] / "all.json.pt"),
                   "model": arch, "steps": torch.load(folders[arch] / "all.json.steps.pt"),
                   "artifacts_after_tapped": artifacts[arch]} for arch in ARCHS}


@pytest.fixture(params=ARCHS)
def engines(request, all_engines) -> dict:
    return all_engines[request.param]


def test_tap_points_leave_the_logprobs_bitwise_equal(engines):
    tapped, plain = engines["tapped"], engines["plain"]
    assert not plain["op_defined"] and tapped["op_defined"]  # the plain engine is vLLM as deployed: no op, no hooks
    assert len(tapped["logprobs"]) > 0
    assert tapped["logprobs"] == plain["logprobs"]  # floats through JSON round-trip exactly


def test_taps_all_captures_the_neutral_set_and_lists_the_rest(engines):
    from divergence_probe.engines.vllm import compiled_taps

    tapped = engines["tapped"]
    family = get_family(tapped["model_type"])
    expected = {t for t in compiled_taps.NEUTRAL + ("router_logits",) if t in family.layer_taps} | set(compiled_taps.OUTSIDE)
    assert set(tapped["layers"]) == expected
    assert set(tapped["generate_layers"]) == expected
    refused = {"resid_mid", "resid_out"} | ({"q_norm", "k_norm"} if engines["model"] != "qwen2_tiny" else set())
    assert refused <= set(tapped["not_captured"]) <= set(compiled_taps.REFUSED)
    assert all(tapped["taps"][name] == "captured" for name in expected)
    assert "FP32" in tapped["not_captured"]["resid_out"]
    message = tapped["explicit_error"]
    assert "resid_out" in message and "--engine eager" in message and "\n" not in message
    plain = engines["plain"]  # an engine built without tap points says so for each layer tap
    assert plain["taps"]["mlp_out"] == compiled_taps.NO_TAP_POINTS and plain["taps"]["logits"] == "captured"


def test_tapped_build_leaves_no_compile_artifact(engines):
    """vLLM's compile-cache keys do not see the hooks: a tapped build must neither save nor load an artifact."""
    assert not [p for p in engines["artifacts_after_tapped"] if "torch_compile_cache" in p]


def _inductor_row_sum(x: torch.Tensor, lanes: int | None = None) -> torch.Tensor:
    """Sum over the last dim in the order of Inductor's vectorised CPU reduction, read from its generated C++ (torch
    2.13, `cpp_fused_..._mean_mul_pow_rsqrt_*` kernels of the tiny Qwen2, AVX-512 machine, hidden size 128): per row,
    one accumulator of `lanes` floats (`Vectorized<float>` for 16, `VectorizedN<float,2>` for 32), zeroed, then
    `acc = acc + x[j:j+lanes]` for j = 0, lanes, 2*lanes... (128 is a multiple of both: no tail, no masked load, no
    split); then `vec_reduce_all<float, N>`: the N 16-float vectors added in order (acc[0] + acc[1]), then the 16
    lanes by the AVX-512 shuffles (256-, 128-, 64-, 32-bit), i.e. a tree of halves; then `0 + that`. For 32 lanes,
    acc[0] + acc[1] is the first halving, so the whole is a tree of halves over `lanes` lanes.
    `lanes` is the kernel's tiling factor (`TilingSelect.select_tiling`): `nelements(bfloat16)` (32 here) when the
    reduction's loop body holds a BF16 value (it reads a BF16 buffer), `nelements(float)` (16 here, what
    `pick_vec_isa()` reports for float) when it reads only FP32 (a norm whose kernel also stores the FP32 residual
    stream, realised by Inductor's read-count threshold, and sums from that buffer: post_norm of layers 1 and 3 of the
    tiny Qwen2 and Qwen3). It is a property of the kernel, not of `x`; left out, the BF16 width, that of 7 of the 9
    norm kernels (on these taps the 16-lane order gives the same bits for the other two; the float width everywhere
    missed input_norm@2). torch's own sum adds in another order, which moves a few last bits."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    width = lanes or pick_vec_isa().nelements(torch.bfloat16) or 1
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


def test_router_taps_are_what_the_graph_routed_with(engines):
    """A mixture of experts: in every layer and for every token, the experts the compiled engine ran a token with
    (its router's ids) are a top-k of the router_logits tap, and their weights are the softmax of those logits
    (norm_topk_prob: over the k chosen), so logits and routes are one step's, one row's. The compare checked its
    routes against its logits for every routed row (RouteRecordError otherwise)."""
    from divergence_probe.numerics import routing

    if engines["model"] != "qwen3_moe_tiny":
        pytest.skip("a dense model has no router")
    raw, tapped = engines["raw"], engines["tapped"]
    taps, layers, config = raw["taps"], raw["num_layers"], raw["config"]
    assert config["norm_topk_prob"]
    prompts = sorted({pid for pid, _, _ in taps})
    for pid in prompts:
        for i in range(layers):
            logits, ids, weights = (taps[(pid, name, i)] for name in ("router_logits", "expert_ids", "expert_weights"))
            assert ids.shape == (logits.shape[0], config["num_experts_per_tok"])
            assert routing.is_admissible_topk(logits, ids).all(), f"layer {i} prompt {pid}"
            chosen = logits.gather(1, ids.long()).float()
            torch.testing.assert_close(weights, torch.softmax(chosen, dim=-1), rtol=2**-7, atol=0)
    rows = sum(taps[(pid, "router_logits", 0)].shape[0] for pid in prompts)
    assert tapped["routed_rows"] == [rows] * layers and tapped["routes_checked"] == rows * layers


def test_each_step_reads_what_that_step_wrote(engines):
    """The host reads the static buffers after each step's model call: a layer's tap follows the tokens: P, then Q
    (another token order), then P again gives P's taps, Q's, then P's again bitwise (a buffer read before its step,
    or never written, hands over another step's rows). The embed tap, taken on the host from each step's input ids,
    is the embedding rows of that step's own token ids in every scoring call and every decode step of generate
    mode."""
    data = engines["steps"]
    embedding = data["embedding"]
    for step in data["steps"]:
        assert torch.equal(step["taps"][("embed", -1)], embedding[torch.tensor(step["ids"])])
    (first, other, again), layer = data["steps"], max(layer for name, layer in data["steps"][0]["taps"] if name == "mlp_out")
    a, b, c = (s["taps"][("mlp_out", layer)] for s in (first, other, again))
    assert torch.equal(a, c)
    differs = next(i for i, (x, y) in enumerate(zip(first["ids"], other["ids"])) if x != y)
    assert all(not torch.equal(a[i], b[i]) for i in range(differs, len(a)))  # causal: from the first other token on
    assert torch.equal(a[:differs], b[:differs])
    assert len(data["generated"]) == 2
    for _, tokens, embed in data["generated"]:
        fed = tokens[:-1]  # the last sampled token is never fed back
        assert embed.shape[0] == len(fed) and torch.equal(embed, embedding[torch.tensor(fed)])
    # every buffer sized for max_num_batched_tokens rows, only for the taps asked for at load
    assert engines["tapped"]["tap_buffer_bytes"] > 0 and engines["plain"]["tap_buffer_bytes"] == 0


@pytest.fixture
def tap_points():
    """Fresh tap points, live (the op writes into them) for the test alone: closed afterwards, the op's owner is
    back to none."""
    from divergence_probe.engines.vllm import compiled_taps

    compiled_taps.register_op()
    points = compiled_taps.TapPoints().live()
    yield points
    points.close()
    assert compiled_taps._OWNER is None


def test_effectful_op_survives_compile(tap_points):
    """Pins the private effect registration: an op that returns nothing, called in a compiled function whose result
    does not use it, must still run (not be removed as dead code), once per call, writing the graph's value into its
    tap's static buffer; the host then reads what the last call wrote, for the selected taps only."""
    from divergence_probe.taps import TapKey

    from divergence_probe.engines.vllm.compiled_taps import EMBED

    key = tap_points.key("swiglu", 0)
    tap_points.make_buffers({key: 8}, rows=8, dtype=torch.float32, device="cpu")

    def f(x):
        y = torch.relu(x) * 2  # exact: eager and Inductor agree bit for bit
        torch.ops.dp.tap(y, key)
        return x + 1

    compiled = torch.compile(f, backend="inductor", fullgraph=True)
    seen = []
    # Inductor's and AOTAutograd's caches key the graph, not the op's effect registration: a graph compiled once
    # without the effect (op dropped) would be served again, so this compile must not read them
    embedding = torch.nn.Embedding(10, 8)
    with torch._inductor.config.patch(force_disable_caches=True):
        for rows in (4, 3):
            x = torch.randn(rows, 8)
            compiled(x)
            ids = torch.arange(rows)
            tap_points.deliver(ids)  # no call active: nothing read
            tap_points.active = tap_points.router(lambda k, t: seen.append((k, t)), frozenset({"swiglu"}), embedding)
            try:
                tap_points.deliver(ids)
            finally:
                tap_points.active = None
            assert torch.equal(seen[-1][1], (torch.relu(x) * 2)[None])
    assert [k for k, _ in seen] == [(TapKey.of("swiglu", 0),)] * 2
    tap_points.active = tap_points.router(lambda k, t: seen.append((k, t)), frozenset({"embed"}), embedding)
    try:
        tap_points.deliver(torch.tensor([7, 2, 7]))  # swiglu not selected for this call; embed from the ids
    finally:
        tap_points.active = None
    assert [k for k, _ in seen[2:]] == [EMBED]
    assert torch.equal(seen[2][1], embedding.weight[[7, 2, 7]])


def test_a_tap_without_a_fitting_buffer_raises(tap_points):
    """A call for a tap the engine has buffers for must find its buffer, large enough, in its dtype: a capture that
    found none would record nothing (or allocate inside the graph), so it raises instead of (re)allocating."""
    key = tap_points.key("attn_out", 1)
    with pytest.raises(ProbeError, match="no buffer"):
        torch.ops.dp.tap(torch.ones(2, 4), key)
    tap_points.buffers[key] = torch.zeros(2, 4)
    for x in (torch.ones(3, 4), torch.ones(2, 5), torch.ones(2, 4, dtype=torch.bfloat16)):
        with pytest.raises(ProbeError, match="does not fit"):
            torch.ops.dp.tap(x, key)
    assert torch.equal(tap_points.buffers[key], torch.zeros(2, 4))
    torch.ops.dp.tap(torch.ones(1, 2, 2), key)  # [rows, heads, dim] lands as [rows, heads * dim]
    assert torch.equal(tap_points.buffers[key], torch.tensor([[1.0] * 4, [0.0] * 4]))


def test_a_call_copies_only_the_taps_it_reads_unless_a_graph_is_captured(tap_points, monkeypatch):
    """Inside a scoring call, a step run without a graph copies only the taps that call reads: another tap's buffer
    keeps what it held. Under CUDA-graph capture, and outside any call (where vLLM captures), every tap is copied: a
    captured graph must serve any later selection."""
    from divergence_probe.engines.vllm import compiled_taps

    read, other = tap_points.key("swiglu", 0), tap_points.key("up_proj", 0)
    tap_points.make_buffers({read: 4, other: 4}, rows=2, dtype=torch.float32, device="cpu")
    x = torch.ones(2, 4)
    tap_points.active = lambda input_ids: None
    tap_points.wanted = tap_points.wanted_keys(frozenset({"swiglu", "embed"}))
    for key in (read, other):
        torch.ops.dp.tap(x, key)
    assert torch.equal(tap_points.buffers[read], x) and torch.equal(tap_points.buffers[other], 0 * x)
    monkeypatch.setattr(compiled_taps, "_capturing", lambda x: True)
    torch.ops.dp.tap(2 * x, other)
    assert torch.equal(tap_points.buffers[other], 2 * x)
    monkeypatch.setattr(compiled_taps, "_capturing", lambda x: False)
    tap_points.active = None
    torch.ops.dp.tap(3 * x, other)
    assert torch.equal(tap_points.buffers[other], 3 * x)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CI has none; docs/results/h200/compiled/ has it)")
def test_cuda_graph_replay_repeats_the_copy(tap_points):
    """Under CUDA-graph capture the Python impl runs once; every replay must repeat its copy into the static buffer.
    As in vLLM: one graph per padded size over a dynamic-shape compile, all writing the first rows of one buffer."""
    key = tap_points.key("swiglu", 0)
    tap_points.buffers[key] = torch.zeros(16, 8, device="cuda")

    def f(x):
        y = torch.relu(x) * 2  # exact: eager and Inductor agree bit for bit
        torch.ops.dp.tap(y, key)
        return x + 1

    compiled = torch.compile(f, backend="inductor", fullgraph=True, dynamic=True)
    inputs = {rows: torch.randn(rows, 8, device="cuda") for rows in (16, 8)}
    graphs = {}
    with torch._inductor.config.patch(force_disable_caches=True):
        for rows, static in inputs.items():
            compiled(static)  # compile and warm up outside the capture
            torch.cuda.synchronize()
            graphs[rows] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[rows]):
                compiled(static)
    buf = tap_points.buffers[key]
    for rows in (16, 8, 8, 16, 8):
        inputs[rows].copy_(torch.randn(rows, 8, device="cuda"))
        graphs[rows].replay()
        assert torch.equal(buf[:rows], torch.relu(inputs[rows]) * 2)


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

    from divergence_probe.engines.protocol import StackSettings
    from divergence_probe.engines.vllm.compiled_taps import wants_tap_points
    from divergence_probe.engines.vllm.engine_start import _engine_key
    from divergence_probe.tap_selection import parse_tap_selection

    compiled = StackSettings(model_path="m", dtype=torch.bfloat16, device="cpu", engine="compiled")
    swiglu = frozenset({"swiglu"})
    assert _engine_key(compiled) != _engine_key(replace(compiled, engine_taps=swiglu))
    # buffers are made for the taps asked for at load: another selection is another engine
    assert _engine_key(replace(compiled, engine_taps=swiglu)) != _engine_key(replace(compiled, engine_taps=swiglu | {"attn_out"}))
    eager = replace(compiled, engine="eager")
    assert _engine_key(eager) == _engine_key(replace(eager, engine_taps=swiglu))
    assert wants_tap_points(parse_tap_selection("all")) and wants_tap_points(parse_tap_selection("swiglu"))
    assert not wants_tap_points(parse_tap_selection("final_norm,logits"))


def test_tap_points_under_cuda_graphs_and_per_selection():
    """CUDA graphs replay the buffer copies, so a compiled engine gets tap points in every cudagraph mode; buffers are
    made for the layer taps asked for at load only (the rest say so in the status); eager engines need none."""
    from dataclasses import replace

    from divergence_probe.engines.vllm import compiled_taps
    from divergence_probe.engines.protocol import StackSettings, freeze_engine_args

    def settings(device, args=None):
        return StackSettings(model_path="m", dtype=torch.bfloat16, device=device, engine="compiled",
                             engine_args=freeze_engine_args(args or {}))

    graphs = {"compilation_config": {"cudagraph_mode": "FULL_AND_PIECEWISE"}}
    everything = frozenset(compiled_taps.NEUTRAL)
    for s in (settings("cuda"), settings("cuda", graphs), settings("cpu")):
        assert compiled_taps.tap_points_for("all", s) == everything
    assert compiled_taps.tap_points_for("input_norm,logits,resid_out", settings("cuda")) == {"input_norm"}
    assert compiled_taps.tap_points_for("logits", settings("cuda")) == frozenset()
    assert compiled_taps.tap_points_for(None, settings("cpu")) == frozenset()
    assert compiled_taps.tap_points_for("all", replace(settings("cuda"), engine="eager")) == frozenset()
    status = compiled_taps.status(frozenset({"swiglu"}))
    assert status["swiglu"] == "captured" and status["attn_out"] == compiled_taps.NOT_BUFFERED
    assert status["embed"] == "captured" and compiled_taps.status(frozenset())["embed"] == "captured"  # a lookup
    assert status["logits"] == "captured" and status["q_norm"] == compiled_taps.REFUSED["q_norm"]
    assert compiled_taps.status(frozenset())["swiglu"] == compiled_taps.NO_TAP_POINTS


def test_engine_noise_checks_tap_points_against_an_engine_without_them(monkeypatch):
    """--engine-noise on a compiled engine with tap points scores a second engine: the same settings without tap
    points, and the summary carries its gap (0 when the tap points are numerically invisible)."""
    import types

    import pandas as pd

    from divergence_probe.runs import batch_invariance
    from divergence_probe.runs.compare import noise_floor_columns
    from divergence_probe.engines.protocol import StackSettings

    built = []

    def fake_row(probe, sequences, other, regions, change, engines):
        built.append((other.engine, other.engine_taps, change))
        return pd.DataFrame([{"stack": "vllm", "side": "infer", "change": change, "mean_abs_dlogp": 0.25 * len(built),
                              "max_abs_dlogp": 1.0, "mean_kl": 0.0, "max_kl": 0.0, "n_tokens": 3}])

    monkeypatch.setattr(batch_invariance, "_engine_row", fake_row)
    settings = StackSettings(model_path="m", dtype=torch.bfloat16, device="cpu", engine="compiled",
                             engine_taps=frozenset({"swiglu"}))
    table = batch_invariance.engine_noise(types.SimpleNamespace(settings=settings,
                                                                config=types.SimpleNamespace(infer="vllm")), [])
    assert [(engine, taps) for engine, taps, _ in built] == [("eager", frozenset()), ("compiled", frozenset())]
    columns = noise_floor_columns(None, None, table)
    assert columns == {"noise_infer_engine_mode_mean_abs_dlogp": 0.25, "tap_points_mean_abs_dlogp": 0.5}
    built.clear()
    untapped = batch_invariance.engine_noise(types.SimpleNamespace(settings=StackSettings(
        model_path="m", dtype=torch.bfloat16, device="cpu", engine="compiled"),
        config=types.SimpleNamespace(infer="vllm")), [])
    assert len(untapped) == 1 and "tap_points_mean_abs_dlogp" not in noise_floor_columns(None, None, untapped)


def test_only_the_taps_asked_for_become_tap_points(tap_points):
    """Each tap point hands a tensor out of the graph, a constraint on Inductor's fusion: an engine asked for some
    taps gets hooks (and buffers) for those alone. Checked on a module tree with vLLM's attribute names."""
    from torch import nn

    class Linear(nn.Linear):
        def __init__(self, n_in, n_out):
            super().__init__(n_in, n_out, bias=False)
            self.input_size_per_partition = n_in

    layer = nn.Module()
    layer.input_layernorm, layer.post_attention_layernorm = nn.LayerNorm(8), nn.LayerNorm(8)
    layer.self_attn, layer.mlp = nn.Module(), nn.Module()
    attn = layer.self_attn
    attn.attn, attn.o_proj, attn.qkv_proj = nn.Identity(), Linear(8, 8), Linear(8, 16)
    attn.q_size, attn.kv_size = 8, 4
    layer.mlp.gate_up_proj, layer.mlp.down_proj = Linear(8, 12), Linear(6, 8)
    model = nn.Module()
    model.model = nn.Module()
    model.model.embed_tokens, model.model.layers = nn.Embedding(10, 8), nn.ModuleList([layer])
    # the family (models/) is found by model_type, and the buffers' widths come from the config, as on vLLM's model
    model.config = SimpleNamespace(model_type="qwen2", hidden_size=8, num_attention_heads=2, head_dim=4,
                                   num_key_value_heads=1, intermediate_size=6, vocab_size=10)

    tap_points.install(model, frozenset({"attn_out", "k_proj"}), rows=4)
    hooked = {name for name, m in model.named_modules() if m._forward_hooks or m._forward_pre_hooks}
    assert hooked == {"model.layers.0.self_attn.o_proj", "model.layers.0.self_attn.qkv_proj"}
    assert tap_points.built == frozenset({"attn_out", "k_proj"})
    assert sorted(tap_points.keys[k].name for k in tap_points.buffers) == ["attn_out", "k_proj"]


def test_router_tap_points_hand_over_one_by_one_in_their_own_dtypes(tap_points):
    """A MoE layer's router taps: router_logits and the route records get buffers of their own (ids int64, weights
    FP32: the router's int32 ids and BF16/FP32 weights widen losslessly; nothing narrows) and are handed over one tap
    at a time, as the routing capture reads them, beside the stacked taps of the other widths."""
    from divergence_probe.taps import TapKey

    keys = {name: tap_points.key(name, 0) for name in ("router_logits", "expert_ids", "expert_weights", "post_norm")}
    # router_logits shares its width with post_norm here: still a buffer of its own
    tap_points.make_buffers({keys["router_logits"]: 8, keys["expert_ids"]: 2, keys["expert_weights"]: 2,
                             keys["post_norm"]: 8}, rows=4, dtype=torch.bfloat16, device="cpu")
    logits = torch.randn(3, 8).bfloat16()
    ids, weights = torch.tensor([[1, 7], [0, 2], [5, 3]], dtype=torch.int32), torch.rand(3, 2)
    torch.ops.dp.tap(logits, keys["router_logits"])
    torch.ops.dp.tap(ids, keys["expert_ids"])
    torch.ops.dp.tap(weights, keys["expert_weights"])
    torch.ops.dp.tap(logits, keys["post_norm"])
    for bad, key in ((ids.float(), "expert_ids"), (weights.double(), "expert_weights"), (logits.float(), "router_logits")):
        with pytest.raises(ProbeError, match="does not fit"):
            torch.ops.dp.tap(bad, keys[key])
    seen = {}
    tap_points.active = tap_points.router(lambda k, t: seen.__setitem__(k, t),
                                          frozenset({"router_logits", "expert_ids", "expert_weights", "post_norm"}),
                                          torch.nn.Embedding(4, 8))
    try:
        tap_points.deliver(torch.arange(3))
    finally:
        tap_points.active = None
    assert set(seen) == {TapKey.of("router_logits", 0), TapKey.of("expert_ids", 0), TapKey.of("expert_weights", 0),
                         (TapKey.of("post_norm", 0),)}
    assert torch.equal(seen[TapKey.of("router_logits", 0)], logits)
    got_ids, got_weights = seen[TapKey.of("expert_ids", 0)], seen[TapKey.of("expert_weights", 0)]
    assert got_ids.dtype == torch.int64 and torch.equal(got_ids, ids.long())
    assert got_weights.dtype == torch.float32 and torch.equal(got_weights, weights)


def test_a_moe_engine_gets_its_route_records_with_its_router_logits():
    """Which tap points a compiled engine gets for a mixture of experts: the route records come with router_logits
    (the compare checks one against the other) or alone when a run replays them; a dense family's selection is what
    it was, and each family's status lists only the taps its layers have."""
    from divergence_probe.engines.protocol import StackSettings
    from divergence_probe.engines.vllm import compiled_taps

    moe, dense = get_family("qwen3_moe"), get_family("qwen3")
    compiled = StackSettings(model_path="m", dtype=torch.bfloat16, device="cpu", engine="compiled")
    everything = compiled_taps.tap_points_for("all", compiled, moe)
    assert everything == {t for t in compiled_taps.NEUTRAL if t in moe.layer_taps} | set(compiled_taps.ROUTER)
    assert compiled_taps.tap_points_for("router_logits", compiled, moe) == set(compiled_taps.ROUTER)
    assert compiled_taps.tap_points_for("none", compiled, moe) == frozenset()
    assert compiled_taps.tap_points_for("none", compiled, moe, routes=True) == {"expert_ids", "expert_weights"}
    assert compiled_taps.tap_points_for("all", compiled, dense) == compiled_taps.tap_points_for("all", compiled)
    status = compiled_taps.status(frozenset({"expert_ids", "expert_weights"}), moe)
    assert "swiglu" not in status and status["router_logits"] == compiled_taps.NOT_BUFFERED
    assert status["expert_ids"] == "captured"
    assert "router_logits" not in compiled_taps.status(frozenset(), dense)
    assert "expert_ids" not in compiled_taps.status(frozenset(), dense)


@pytest.mark.parametrize("why", ["fused gate", "monolithic"])
def test_an_engine_whose_router_never_runs_is_refused(why):
    """Tap points on the gate and on select_experts see the routing only if both run: a gate fused with a
    shared-expert gate, or an experts kernel that routes inside itself, is refused in one line."""
    from torch import nn

    from divergence_probe.engines.vllm import compiled_taps

    layer = nn.Module()
    layer.mlp = nn.Module()
    layer.mlp.experts = nn.Module()
    layer.mlp.experts._fse_fuse_gate = why == "fused gate"
    layer.mlp.experts.is_monolithic = why == "monolithic"
    layer.mlp.experts._quant_method = SimpleNamespace()
    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList([layer])
    model.config = SimpleNamespace(model_type="qwen3_moe")
    with pytest.raises(ProbeError) as e:
        compiled_taps.check_routes(model)
    assert "layer 0" in str(e.value) and "--engine eager" in str(e.value) and "\n" not in str(e.value)
    layer.mlp.experts._fse_fuse_gate = layer.mlp.experts.is_monolithic = False
    compiled_taps.check_routes(model)
