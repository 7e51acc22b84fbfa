"""Check the router facts of docs/design/moe.md by running them: a tiny Qwen3-MoE in vLLM and in transformers.

    .venv/bin/python docs/design/moe_probe.py                 # builds the tiny MoE into a temp folder
    .venv/bin/python docs/design/moe_probe.py --model DIR --prompts 16 --tokens 128

vLLM (enforce_eager, BF16, CPU, in-process engine: VLLM_ENABLE_V1_MULTIPROCESSING=0) runs with a forward hook on
every layer's `mlp.gate` and with enable_return_routed_experts where this vLLM accepts it; where it does not (the
CPU build: it needs model runner V2, which needs Triton), the same ids are taken where the record takes them, from
each MoERunner router's capture callback. transformers runs with a hook on every `mlp.gate` (Qwen3MoeTopKRouter).
One prompt per forward on both sides. Printed: where each side's router logits come from (module, dtype, shape),
vLLM's expert tensors after load against the trainer's, whether vLLM's record is a top-k of its own hooked logits
for every token and layer (prompt and decode rows), per-layer flip rates vs transformers (routing.py), |Δlogp|
with and without an upstream flip, an R3 replay of the record in transformers, and each step's time.

vLLM's CPU backend hosts one engine per process: this script starts exactly one, and needs the `__main__` guard.
A probe, not a test: it prints what it sees and asserts nothing, so that a surprising fact is reported, not hidden.
"""

import argparse
import os
import tempfile
import time
from pathlib import Path


def log(msg: str) -> None:
    print(msg, flush=True)


class Timer:
    def __init__(self):
        self.rows: list[tuple[str, float]] = []

    def __call__(self, name):
        timer = self

        class _Step:
            def __enter__(self):
                self.t = time.perf_counter()

            def __exit__(self, *exc):
                timer.rows.append((name, time.perf_counter() - self.t))

        return _Step()


def prompts_from_corpus(tokenizer, n: int, length: int) -> list[list[int]]:
    """n windows of `length` token ids from the packaged tokenizer corpus (real text, so routing is not uniform)."""
    from importlib import resources

    text = resources.files("divergence_probe").joinpath("data/tokenizer_corpus.txt").read_text(encoding="utf-8")
    ids = tokenizer(text)["input_ids"]
    stride = max(length, (len(ids) - length) // n)
    return [ids[i * stride: i * stride + length] for i in range(n)]


def find_runner(llm):
    """The in-process model runner (stacks/vllm/stack.py's _find_runner; repeated so this probe stands alone)."""
    import torch

    for path in (("model_executor", "driver_worker", "worker", "model_runner"),
                 ("engine_core", "engine_core", "model_executor", "driver_worker", "worker", "model_runner")):
        obj = llm.llm_engine
        for name in path:
            obj = getattr(obj, name, None)
        if isinstance(getattr(obj, "model", None), torch.nn.Module) or callable(getattr(obj, "get_model", None)):
            return obj
    raise SystemExit("cannot reach vLLM's model in-process")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="a Qwen3-MoE checkpoint; default: build the tiny one")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--decode", type=int, default=8, help="tokens to sample for the decode-step record check")
    ap.add_argument("--fused-checkpoint", action="store_true",
                    help="give vLLM the checkpoint re-saved in transformers' fused expert layout "
                         "(save_original_format=False: experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I])")
    args = ap.parse_args()

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process, so hooks reach the model
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from divergence_probe import routing
    from divergence_probe.modelzoo import make_model

    timer = Timer()
    tmp = tempfile.TemporaryDirectory()
    path = args.model
    if path is None:
        with timer("build tiny MoE"):
            path = make_model(Path(tmp.name) / "tiny-moe", arch="qwen3_moe", preset="tiny", seed=0)
    tok = AutoTokenizer.from_pretrained(path)
    prompts = prompts_from_corpus(tok, args.prompts, args.tokens)

    # ---------------------------------------------------------------- transformers
    with timer("transformers load"):
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    hf.eval()
    cfg = hf.config
    top_k, n_layers = cfg.num_experts_per_tok, cfg.num_hidden_layers
    log(f"model {path}: {n_layers} layers, {cfg.num_experts} experts, top-{top_k}, "
        f"norm_topk_prob={cfg.norm_topk_prob}, experts implementation {cfg._experts_implementation!r}")
    gates = [layer.mlp.gate for layer in hf.model.layers]
    log(f"transformers gate: {type(gates[0]).__module__}.{type(gates[0]).__qualname__}, "
        f"weight {tuple(gates[0].weight.shape)} {gates[0].weight.dtype}; experts "
        + ", ".join(f"{n} {tuple(p.shape)}" for n, p in hf.model.layers[0].mlp.experts.named_parameters()))
    hf_logits: list[list[torch.Tensor]] = [[] for _ in prompts]  # [prompt][layer] -> [T, E]
    current = {}

    def hf_hook(i):
        def hook(module, inputs, output):
            current.setdefault(i, []).append(output)
        return hook

    handles = [g.register_forward_hook(hf_hook(i)) for i, g in enumerate(gates)]
    hf_logp, hf_own = [], 0
    with timer(f"transformers forward ({len(prompts)} prompts, hooked)"), torch.no_grad():
        for p, ids in enumerate(prompts):
            current.clear()
            logits = hf(torch.tensor([ids])).logits[0].float()
            hf_logp.append(logits.log_softmax(-1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0])
            for i in range(n_layers):
                (out,) = current[i]
                router_logits, weights, indices = out
                hf_logits[p].append(router_logits)
                hf_own += int(routing.is_admissible_topk(router_logits, indices).sum())
    for h in handles:
        h.remove()
    rl, w, ix = current[0][0]
    log(f"transformers router output: logits {tuple(rl.shape)} {rl.dtype}, weights {tuple(w.shape)} {w.dtype}, "
        f"indices {tuple(ix.shape)} {ix.dtype}")
    # Is transformers' own pick a top-k of its logits (it ranks FP32 softmax probabilities)?
    log(f"transformers indices are a top-k of its router logits: {hf_own}/{sum(map(len, prompts)) * n_layers} "
        "token-layers")

    # ---------------------------------------------------------------- vLLM
    from vllm import LLM, EngineArgs, SamplingParams
    from vllm.inputs import TokensPrompt

    engine_path = path
    if args.fused_checkpoint:
        engine_path = Path(tmp.name) / "fused"
        hf.save_pretrained(engine_path, save_original_format=False)
        tok.save_pretrained(engine_path)
        from safetensors import safe_open

        with safe_open(engine_path / "model.safetensors", "pt") as f:
            fused = sorted(k for k in f.keys() if "layers.0.mlp" in k)
            log("fused checkpoint for vLLM, layer-0 mlp tensors: " + ", ".join(
                f"{k} {tuple(f.get_slice(k).get_shape())}" for k in fused))
    engine_kw = dict(model=str(engine_path), dtype="bfloat16", enforce_eager=True, seed=0,
                     max_model_len=max(1024, args.tokens + args.decode + 8), gpu_memory_utilization=0.5)
    # enable_return_routed_experts is wired to model runner V2 only, and needs prefix caching (vllm/config/vllm.py,
    # _verify_aux_output_compatibility). Check the config first: a refused config starts no engine.
    record_kw = dict(enable_return_routed_experts=True, enable_prefix_caching=True)
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    try:
        EngineArgs(**engine_kw, **record_kw).create_engine_config()
        engine_record = True
    except (ValueError, TypeError) as e:  # TypeError: a vLLM without the flag
        engine_record = False
        reason = " ".join(str(e).split())
        log(f"enable_return_routed_experts refused by this vLLM: {reason[reason.find('Value error'):][:160]}")
        log("falling back to the same callback the record is filled from: MoERunner.router.set_capture_fn "
            "(BaseRouter._select_experts calls it with the logical expert ids, before EPLB mapping)")
        os.environ.pop("VLLM_USE_V2_MODEL_RUNNER")
        record_kw = dict(enable_prefix_caching=True)  # the record's configuration, so both paths run alike

    with timer("vLLM engine start"):
        llm = LLM(**engine_kw, **record_kw)
    runner = find_runner(llm)
    model = runner.get_model() if callable(getattr(runner, "get_model", None)) else runner.model
    log(f"vLLM model runner {type(runner).__module__}.{type(runner).__qualname__}")
    vgates = {name: m for name, m in model.named_modules() if name.endswith(".mlp.gate")}
    names = sorted(vgates, key=lambda n: int(n.split(".layers.")[1].split(".")[0]))
    log(f"vLLM gates: {names[0]} … ({len(names)}): {type(vgates[names[0]]).__module__}."
        f"{type(vgates[names[0]]).__qualname__}, out_dtype={getattr(vgates[names[0]], 'out_dtype', None)}")
    mlp0 = model.model.layers[0].mlp
    log("vLLM layer-0 mlp modules: " + ", ".join(f"{n}:{type(m).__name__}" for n, m in mlp0.named_modules()
                                                  if n and n.count(".") < 2))
    log("vLLM layer-0 mlp tensors after load: " + ", ".join(
        f"{n} {tuple(t.shape)} {t.dtype}" for n, t in list(mlp0.named_parameters()) + list(mlp0.named_buffers())))
    experts = mlp0.experts
    router = getattr(experts, "router", None)
    method = getattr(experts, "_quant_method", None)
    kernel = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
    log(f"vLLM experts: {type(experts).__qualname__}; router {type(router).__qualname__ if router else None}; "
        f"quant method {type(method).__qualname__}; kernel {type(kernel).__qualname__}")

    # what rl's weight-sync check would compare: vLLM's w13/w2 against the trainer's experts, as stored and as
    # the CPU kernel's prepack (same shape, AMX tile order) would store the trainer's tensors
    routed = getattr(experts, "routed_experts", experts)  # vLLM 0.24 (CUDA): the weights sit on FusedMoE itself
    hf_e = hf.model.layers[0].mlp.experts
    w13, w2 = routed.w13_weight.cpu(), routed.w2_weight.cpu()
    log(f"w13 equals transformers' gate_up_proj as stored: {torch.equal(w13, hf_e.gate_up_proj)}; "
        f"w2 equals down_proj: {torch.equal(w2, hf_e.down_proj)}")
    if hasattr(kernel, "isa"):
        from vllm._custom_ops import cpu_prepack_moe_weight

        log(f"w13 equals cpu_prepack_moe_weight(gate_up_proj, {kernel.isa!r}): "
            f"{torch.equal(routed.w13_weight, cpu_prepack_moe_weight(hf_e.gate_up_proj.data.contiguous(), kernel.isa))}; "
            f"w2 equals cpu_prepack_moe_weight(down_proj): "
            f"{torch.equal(routed.w2_weight, cpu_prepack_moe_weight(hf_e.down_proj.data.contiguous(), kernel.isa))}")

    vcap: dict[int, list[torch.Tensor]] = {}
    ids_cap: dict[int, list[torch.Tensor]] = {}

    def v_hook(i):
        def hook(module, inputs, output):
            out = output[0] if isinstance(output, tuple) else output
            vcap.setdefault(i, []).append(out.detach().to("cpu", copy=True))
        return hook

    vhandles = [vgates[n].register_forward_hook(v_hook(i)) for i, n in enumerate(names)]
    runners = [model.model.layers[i].mlp.experts for i in range(n_layers)]
    if not engine_record:
        for i, r in enumerate(runners):
            r.router.set_capture_fn(lambda topk_ids, i=i: ids_cap.setdefault(i, []).append(topk_ids.clone()))

    def record(res) -> torch.Tensor:
        """[rows, layers, top_k] int64: the engine's record, or what its capture callback saw this call."""
        if engine_record:
            return torch.as_tensor(res.outputs[0].routed_experts.astype("int64"))
        return torch.stack([torch.cat(ids_cap[i]).long() for i in range(n_layers)], dim=1)

    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    v_logits, v_routed, v_logp, forwards = [], [], [], []
    with timer(f"vLLM generate ({len(prompts)} prompts, one per call, hooked + record)"):
        for ids in prompts:
            vcap.clear()
            ids_cap.clear()
            (res,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)
            forwards.append(len(vcap[0]))
            v_logits.append([torch.cat(vcap[i]) for i in range(n_layers)])
            v_routed.append(record(res))
            v_logp.append(torch.tensor([res.prompt_logprobs[t][ids[t]].logprob for t in range(1, len(ids))]))
    log(f"vLLM gate hook: forwards per prompt {sorted(set(forwards))}, logits {tuple(v_logits[0][0].shape)} "
        f"{v_logits[0][0].dtype}")
    r0 = res.outputs[0].routed_experts if engine_record else None
    log(f"{'routed_experts' if engine_record else 'captured ids'} for a {len(prompts[0])}-token prompt, "
        f"max_tokens=1: {tuple(v_routed[0].shape)}"
        + (f" ({type(r0).__name__} {r0.dtype})" if engine_record else f" ({ids_cap[0][0].dtype})"))

    # the record against the hooked logits, token by token and layer by layer
    with timer("record check"):
        bad, order_desc, canon, total = [], 0, 0, 0
        for p, (rec, layers) in enumerate(zip(v_routed, v_logits)):
            for i in range(n_layers):
                ok = routing.is_admissible_topk(layers[i], rec[:, i, :])
                bad += [(p, i, int(t)) for t in (~ok).nonzero()[:, 0]]
                vals = layers[i].double().gather(1, rec[:, i, :])
                order_desc += int((vals[:, :-1] >= vals[:, 1:]).all(-1).sum())
                canon += int((torch.sort(routing.topk_ids(layers[i], top_k), -1).values ==
                              torch.sort(rec[:, i, :], -1).values).all(-1).sum())
                total += rec.shape[0]
        log(f"record is a top-k of vLLM's hooked logits: {total - len(bad)}/{total} token-layers"
            + (f"; first mismatches (prompt, layer, token): {bad[:5]}" if bad else ""))
        log(f"record lists experts in descending logit order for {order_desc}/{total} token-layers "
            f"(CPURouter: torch.topk sorted=False)")
        log(f"record set equals the canonical (value, then lower id) top-k set: {canon}/{total}")

    # decode: the record for sampled tokens, on a prompt the engine has not seen (nothing in its prefix cache),
    # then on prompt 0 again, whose prompt blocks are cached: the gate never sees those rows; the engine's record
    # must still hold them (from its block store) and equal the first run's
    fresh = tok("A prompt the engine has not seen before: the quick brown fox jumps over the lazy dog.")["input_ids"]
    for name, ids in (("fresh prompt", fresh), ("prompt 0 again (prefix cached)", prompts[0])):
        vcap.clear()
        ids_cap.clear()
        with timer(f"vLLM generate, {name}, {args.decode} sampled tokens"):
            (res,) = llm.generate([TokensPrompt(prompt_token_ids=ids)],
                                  SamplingParams(max_tokens=args.decode, temperature=1.0, seed=0, ignore_eos=True),
                                  use_tqdm=False)
        rec = record(res)
        hooked = [torch.cat(vcap[i]) for i in range(n_layers)]
        steps = hooked[0].shape[0]  # the rows the engine computed: uncached prompt rows, then one per decode step
        tail = rec[rec.shape[0] - steps:] if steps <= rec.shape[0] else None
        ok = tail is not None and all(routing.is_admissible_topk(hooked[i], tail[:, i, :]).all().item()
                                      for i in range(n_layers))
        log(f"decode, {name}: prompt {len(ids)} + {len(res.outputs[0].token_ids)} sampled -> record "
            f"{tuple(rec.shape)}; gate rows computed {steps} in {len(vcap[0])} forwards; the record's last "
            f"{steps} rows are their top-k: {ok}")
        if ids is prompts[0] and engine_record:
            n = min(len(v_routed[0]), len(rec))
            log(f"  cached prompt rows in the record equal the first run's record: "
                f"{torch.equal(rec[:n], v_routed[0][:n])}")
    # ---------------------------------------------------------------- flips vLLM vs transformers
    with timer("routing metrics"):
        per_layer = [routing.compare_layer(torch.cat([v[i] for v in v_logits]), torch.cat([h[i] for h in hf_logits]),
                                           top_k) for i in range(n_layers)]
        for i, r in enumerate(per_layer):
            a = torch.cat([v[i] for v in v_logits]).float()
            b = torch.cat([h[i] for h in hf_logits]).float()
            row = routing.layer_metrics(r)
            log(f"layer {i}: router logits rel_l2 {((a - b).norm() / b.norm()).item():.2e}, bitwise equal "
                f"{(a == b).double().mean().item():.1%}; " + ", ".join(
                    f"{k} {v:.3g}" for k, v in row.items() if k != "tokens"))
        flips, first = routing.token_flips(per_layer)
        seq = torch.cat([torch.full((len(ids),), p) for p, ids in enumerate(prompts)])
        # |Δlogp| of the token each row predicts: row t's logits score token t+1; a prompt's last row scores none
        starts = [sum(len(x) for x in prompts[:p]) for p in range(len(prompts))]
        rows = torch.cat([torch.arange(len(ids) - 1) + start for start, ids in zip(starts, prompts)])
        dlogp = torch.cat([(v - h).abs() for v, h in zip(v_logp, hf_logp)])
        log(f"tokens {len(flips)}, frac_tokens_any_flip {routing.frac_tokens_any_flip(flips):.3f}, "
            f"first_flip_layer histogram {torch.bincount(first + 1).tolist()} (index 0: none)")
        for scope in ("position", "prefix"):
            up = routing.upstream_flips(flips > 0, seq, scope=scope)[rows]
            log(f"|Δlogp| by upstream flip ({scope}): " + ", ".join(
                f"{k} {v:.3g}" for k, v in routing.dlogp_by_upstream_flip(dlogp, up).items()))

    # ---------------------------------------------------------------- R3 replay in transformers
    def replay_hook(forced: torch.Tensor):
        """Qwen3MoeTopKRouter's output with vLLM's expert ids and transformers' own weights for them: the
        softmax over all experts in FP32, gathered at the forced ids, renormalised as norm_topk_prob says."""
        def hook(module, inputs, output):
            logits, _, _ = output
            probs = torch.softmax(logits, dtype=torch.float, dim=-1).gather(1, forced)
            if module.norm_topk_prob:
                probs = probs / probs.sum(-1, keepdim=True)
            return logits, probs.to(logits.dtype), forced
        return hook

    used: dict[int, torch.Tensor] = {}
    ehooks = [layer.mlp.experts.register_forward_hook(
        lambda m, inp, out, i=i: used.__setitem__(i, inp[1].clone())) for i, layer in enumerate(hf.model.layers)]
    replay_dlogp, replay_equal, replay_flips = [], True, []
    with timer(f"transformers forward, R3 replay ({len(prompts)} prompts)"), torch.no_grad():
        for p, ids in enumerate(prompts):
            rec = v_routed[p]
            hs = [g.register_forward_hook(replay_hook(rec[:, i, :])) for i, g in enumerate(gates)]
            try:
                logits = hf(torch.tensor([ids])).logits[0].float()
            finally:
                for h in hs:
                    h.remove()
            lp = logits.log_softmax(-1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
            replay_dlogp.append((v_logp[p] - lp).abs())
            replay_equal &= all(torch.equal(used[i], rec[:, i, :]) for i in range(n_layers))
    for h in ehooks:
        h.remove()
    log(f"R3 replay: transformers' experts received vLLM's ids for every token and layer: {replay_equal}; "
        f"mean |Δlogp| {torch.cat(replay_dlogp).mean().item():.3g} (no replay {dlogp.mean().item():.3g})")

    log("timings: " + "; ".join(f"{name} {s:.2f}s" for name, s in timer.rows))


if __name__ == "__main__":
    main()
