"""Benchmark the tool against the two processes a user would otherwise run: one that scores the prompts in vLLM, one
that scores them in transformers; and `compare --taps none` and `--taps all` on the same prompts. Whole processes,
interleaved on the same machine, so the ratios hold while its speed drifts.

    .venv/bin/python benchmarks/bench_processes.py                      # the built-in model, 8 sample prompts, CPU
    .venv/bin/python benchmarks/bench_processes.py --rounds 1 --num-prompts 2 --out /tmp/p.json   # the CI smoke size
    python3 benchmarks/bench_processes.py --device cuda --preset qwen2.5-1.5b --num-prompts 32 \\
        --max-prompt-tokens 1024 --rounds 2 --breakdown --out /tmp/gpu.json    # the GPU rows (docs/benchmarks.md)
    .venv/bin/python benchmarks/bench_processes.py --render /tmp/gpu.json     # those numbers into docs/benchmarks.md

Targets (docs/benchmarks.md): on a GPU at the Qwen2.5-1.5B shape, `compare --taps none` at most 0.7x the two bare
processes together and `--taps all` at most 1.05x `--taps none`; on the CPU no target, the ratios are reported.

Each round runs the four processes once, in an order rotated from round to round (a process that runs right after
another finds the page cache and the CPU's clocks as that one left them); each is timed from its start to its exit by
this script. The bare processes are what a user's two scripts would be: the engine's own prompt logprobs
(`prompt_logprobs=0`, eager engine, prefix caching off, as the tool builds it), and a transformers model's log-softmax
of each prompt's logits, one prompt per forward; both read the token ids this script tokenized once with the tool's
own prompt loader, so all four score the same tokens. With --breakdown, one more `compare --taps all` runs with
DIVERGENCE_PROBE_TIMINGS=1 (outside the rounds: timing synchronizes the device after each phase) and its manifest's
phase seconds are kept. A --preset builds a random checkpoint of that shape once (make-model; kept in --models-dir).
The raw numbers go to docs/benchmarks/ (bench_processes.json; with --device cuda bench_processes_cuda.json, with
--engine compiled the suffix _compiled after it) and to the section of docs/benchmarks.md between the markers of that
name; with --out, only the JSON, there.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from docs_section import add_out_argument, write_section  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("transformers", "vllm", "taps_none", "taps_all")
TARGETS = {"cuda": {"taps_none_over_bare": 0.7, "taps_all_over_taps_none": 1.05}}
CHILD_TIMEOUT_S = 1800


def _vllm_child(model: str, ids_file: str, device: str, dtype: str, engine: str, max_model_len: int,
                batch_tokens: int) -> None:
    """A user's vLLM script: start an engine, score every prompt's tokens (prompt_logprobs), print the sum."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import vllm
    from vllm.inputs import TokensPrompt

    if device == "cuda":
        try:
            import flashinfer  # noqa: F401
        except ImportError:  # vLLM 0.24 imports it unguarded for its sampler on CUDA
            import vllm.v1.sample.ops.topk_topp_sampler as sampler
            sampler.flashinfer_sampler_supported = lambda: False
    prompts = json.loads(Path(ids_file).read_text())
    mode = {"enforce_eager": True, "enable_chunked_prefill": False} if engine == "eager" else {}
    llm = vllm.LLM(model=model, skip_tokenizer_init=True, dtype=dtype, seed=0, max_model_len=max_model_len,
                   max_num_batched_tokens=max(batch_tokens, max_model_len), enable_prefix_caching=False,
                   gpu_memory_utilization=0.3 if device == "cpu" else 0.5, **mode)
    params = vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], params, use_tqdm=False)
    total = sum(entry[tok].logprob for out, ids in zip(outs, prompts)
                for entry, tok in zip(out.prompt_logprobs[1:], ids[1:]))
    print(json.dumps({"sum_logprob": total}))


def _transformers_child(model: str, ids_file: str, device: str, dtype: str) -> None:
    """A user's transformers script: load the model, one forward per prompt, the log-softmax of each next token."""
    import torch
    from transformers import AutoModelForCausalLM

    prompts = json.loads(Path(ids_file).read_text())
    net = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).to(device).eval()
    total = 0.0
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids], device=device)
            logprobs = torch.log_softmax(net(x).logits[0, :-1].float(), dim=-1)
            total += float(logprobs.gather(-1, x[0, 1:, None]).sum())
    print(json.dumps({"sum_logprob": total}))


def _model(args) -> str:
    if args.model:
        return args.model
    if args.preset is None:
        from divergence_probe.models.modelzoo import default_model_path
        return str(default_model_path())
    path = Path(args.models_dir) / f"{args.preset}-seed0"
    if not (path / "config.json").exists():
        from divergence_probe.models.modelzoo import make_model
        make_model(path, preset=args.preset, seed=0)
    return str(path)


def _prompt_ids(model: str, args) -> tuple[list[list[int]], int]:
    """The token ids the tool scores for these prompt settings (its own loader, on the model's tokenizer), and the
    model's context length."""
    from transformers import AutoTokenizer

    from divergence_probe.models.source import resolve_model
    from divergence_probe.prompts import load_prompts

    source = resolve_model(model)
    tokenizer = AutoTokenizer.from_pretrained(source.path)
    prompts = load_prompts(args.prompts, tokenizer, num_prompts=args.num_prompts,
                           max_prompt_tokens=args.max_prompt_tokens, max_model_len=source.max_model_len)
    return [list(p.token_ids) for p in prompts], source.max_model_len


def _commands(model: str, ids_file: Path, args, max_model_len: int, run_dir: Path) -> dict[str, list[str]]:
    me = [sys.executable, str(Path(__file__).resolve())]
    tool = [sys.executable, "-m", "divergence_probe", "compare", "--model", model, "--device", args.device,
            "--dtype", args.dtype, "--engine", args.engine, "--batch-tokens", str(args.batch_tokens),
            *(["--prompts", str(args.prompts)] if args.prompts else []),
            *(["--num-prompts", str(args.num_prompts)] if args.num_prompts else []),
            *(["--max-prompt-tokens", str(args.max_prompt_tokens)] if args.max_prompt_tokens else [])]
    return {
        "transformers": [*me, "--child", "transformers", model, str(ids_file), args.device, args.dtype],
        "vllm": [*me, "--child", "vllm", model, str(ids_file), args.device, args.dtype, args.engine, str(max_model_len),
                 str(args.batch_tokens)],
        "taps_none": [*tool, "--taps", "none", "--out", str(run_dir / "none")],
        "taps_all": [*tool, "--taps", "all", "--out", str(run_dir / "all")],
    }


def _run(cmd: list[str], env: dict) -> float:
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    return seconds


def _clear(run_dir: Path) -> None:
    import shutil
    for name in ("none", "all", "breakdown"):
        shutil.rmtree(run_dir / name, ignore_errors=True)


def _versions() -> dict:
    """The distributions' versions (vLLM's CPU build is the vllm-cpu distribution), None where one is missing."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for key, names in (("torch", ("torch",)), ("transformers", ("transformers",)), ("vllm", ("vllm", "vllm-cpu"))):
        out[key] = None
        for name in names:
            try:
                out[key] = version(name)
                break
            except PackageNotFoundError:
                continue
    return out


def _commit() -> str | None:
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    except OSError:  # no git on the machine
        return None
    if done.returncode != 0:
        return None
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    return done.stdout.strip() + ("+changes" if dirty else "")


def measure(args) -> dict:
    model = _model(args)
    ids, max_model_len = _prompt_ids(model, args)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("DIVERGENCE_PROBE_TIMINGS", None)
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    breakdown = None
    with tempfile.TemporaryDirectory() as tmp:
        ids_file = Path(tmp) / "ids.json"
        ids_file.write_text(json.dumps(ids))
        commands = _commands(model, ids_file, args, max_model_len, Path(tmp))
        for r in range(args.rounds):
            order = KINDS[r % len(KINDS):] + KINDS[: r % len(KINDS)]
            for kind in order:
                _clear(Path(tmp))
                times[kind].append(round(_run(commands[kind], env), 3))
                print(f"round {r + 1}: {kind} {times[kind][-1]:.1f} s", flush=True)
        if args.breakdown:
            _clear(Path(tmp))
            cmd = [*commands["taps_all"][:-1], str(Path(tmp) / "breakdown")]
            wall = _run(cmd, env | {"DIVERGENCE_PROBE_TIMINGS": "1"})
            manifest = json.loads((Path(tmp) / "breakdown" / "manifest.json").read_text())
            breakdown = {"wall_s": round(wall, 3), "timings": manifest.get("timings"),
                         "tap_reduction": manifest["compare"].get("tap_reduction")}
    return {
        "device": args.device, "model": model if args.model else (args.preset or "built-in"),
        "preset": args.preset, "dtype": args.dtype, "engine": args.engine, "num_prompts": len(ids),
        "prompt_tokens": sum(map(len, ids)), "max_prompt_tokens": args.max_prompt_tokens,
        "batch_tokens": args.batch_tokens, "rounds": args.rounds, "times_s": times,
        "ratios": ratios(times), "breakdown": breakdown, "targets": TARGETS.get(args.device),
        "versions": _versions(), "commit": args.commit or _commit(), "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs" + (f", {_gpu()}" if args.device == "cuda" else ""),
        "command": " ".join([Path(sys.executable).name, "benchmarks/bench_processes.py", *sys.argv[1:]]),
    }


def _gpu() -> str:
    import torch
    return torch.cuda.get_device_name(0)


def ratios(times: dict[str, list[float]]) -> dict[str, list[float]]:
    """Per round: the tool over the two bare processes together, and taps all over taps none."""
    rounds = range(min(map(len, times.values())))
    bare = [times["transformers"][r] + times["vllm"][r] for r in rounds]
    return {"taps_none_over_bare": [round(times["taps_none"][r] / bare[r], 3) for r in rounds],
            "taps_all_over_bare": [round(times["taps_all"][r] / bare[r], 3) for r in rounds],
            "taps_all_over_taps_none": [round(times["taps_all"][r] / times["taps_none"][r], 3) for r in rounds]}


def render(raw: dict) -> str:
    """The docs section: every round's seconds, each ratio per round, the breakdown if measured."""
    v = raw["versions"]
    where = "GPU" if raw["device"] == "cuda" else "CPU"
    lines = [f"## The tool against two bare processes ({where})", "",
             f"`{raw['command']}` — {raw['model']}, {raw['num_prompts']} prompts, {raw['prompt_tokens']} tokens, "
             f"{raw['dtype']}, {raw['engine']} engine, {raw['rounds']} interleaved round(s); {raw['machine']}; "
             f"vLLM {v.get('vllm')}, torch {v.get('torch')}, transformers {v.get('transformers')}, "
             f"Python {v.get('python')}; {raw['date']}, commit {raw['commit']}. Whole processes, seconds."
             + (f" {raw['note']}" if raw.get("note") else ""), "",
             "| round | transformers | vLLM | both | compare --taps none | compare --taps all | none / both | "
             "all / both | all / none |", "|---|---|---|---|---|---|---|---|---|"]
    t, q = raw["times_s"], raw["ratios"]
    for r in range(len(q["taps_none_over_bare"])):
        lines.append(f"| {r + 1} | {t['transformers'][r]:.1f} | {t['vllm'][r]:.1f} | "
                     f"{t['transformers'][r] + t['vllm'][r]:.1f} | {t['taps_none'][r]:.1f} | {t['taps_all'][r]:.1f} | "
                     f"{q['taps_none_over_bare'][r]:.2f}x | {q['taps_all_over_bare'][r]:.2f}x | "
                     f"{q['taps_all_over_taps_none'][r]:.2f}x |")
    if raw.get("targets"):
        med = {k: statistics.median(x) for k, x in q.items()}
        lines += ["", "Targets: " + "; ".join(
            f"{name.replace('_', ' ')} at most {limit}x (median {med[name]:.2f}x: "
            f"{'met' if med[name] <= limit else 'not met'})" for name, limit in raw["targets"].items())]
    if raw.get("breakdown") and raw["breakdown"].get("timings"):
        b = raw["breakdown"]
        lines += ["", f"Breakdown of one more `compare --taps all` with DIVERGENCE_PROBE_TIMINGS=1 ({b['wall_s']:.1f} s "
                  f"whole process; tap reduction: {b['tap_reduction']}); nested phases include their children:", "",
                  "| phase | seconds |", "|---|---|"]
        lines += [f"| {name} | {s:.2f} |" for name, s in b["timings"].items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        kind, rest = sys.argv[2], sys.argv[3:]
        if kind == "vllm":
            _vllm_child(*rest[:5], int(rest[5]), int(rest[6]))
        else:
            _transformers_child(*rest)
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--model", default=None, help="a checkpoint folder; default: the built-in model (or --preset)")
    ap.add_argument("--preset", default=None, help="build a random checkpoint of this make-model preset")
    ap.add_argument("--models-dir", default=str(Path(tempfile.gettempdir()) / "dp-bench-models"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--engine", default="eager", choices=("eager", "compiled"),
                    help="the engine mode of the bare vLLM process and of both compares")
    ap.add_argument("--prompts", default=None, help="default: the packaged sample prompts")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-prompt-tokens", type=int, default=None)
    ap.add_argument("--batch-tokens", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--breakdown", action="store_true", help="one more timed compare --taps all, its phases kept")
    ap.add_argument("--note", default=None, help="a sentence for the section: the machine's load, say")
    ap.add_argument("--commit", default=None, help="the commit measured, where the copy has no git history")
    ap.add_argument("--render", type=Path, default=None, help="write the docs section from this JSON and stop")
    add_out_argument(ap)
    args = ap.parse_args()
    raw = json.loads(args.render.read_text()) if args.render else measure(args)
    if args.note:
        raw["note"] = args.note
    name = "bench_processes" + ("_cuda" if raw["device"] == "cuda" else "") + \
        ("_compiled" if raw["engine"] == "compiled" else "")
    write_section(name, render(raw), raw, None if args.render else args.out)
    print(render(raw))


if __name__ == "__main__":
    main()
