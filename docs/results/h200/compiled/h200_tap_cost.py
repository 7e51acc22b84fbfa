"""What layer taps cost under vLLM's compiled engine (issue 13's target: compare --taps all <= 1.3x the untapped compare),
and where that time goes, on a GPU.

    cd REPO; export PYTHONPATH=$HOME/site:$PWD:$PWD/benchmarks; P=qwen2.5-1.5b
    python3 docs/results/h200/compiled/h200_tap_cost.py --preset $P --out /tmp/tapcost/$P     # both engines, calls interleaved
    python3 docs/results/h200/compiled/h200_tap_cost.py --preset tiny --device cpu --out /tmp/tapcost/tiny --reps 2   # a CPU dry run

Two engines, each in a process of its own (one engine per process), loaded one after the other and then alive
together: **plain**, built without tap points (what `--taps none` builds: vLLM as deployed), and **tapped**, built
with them (`taps="all"`), each pinned to its own half of this process's CPU cores. This process drives both and runs
one call at a time, interleaving the engines call by call (plain taps none, tapped taps all, tapped taps none, in an
order rotated each round). So the machine's drift over a run (on the H200 as large as the margin to the target) falls
on both engines alike, not on whichever ran second, and each round's ratio of neighbouring calls is reported too.
Two workloads, each a `compare`:
  short  the first 16 shipped prompts, as they are (all shorter than 1024 tokens): few tokens per prompt, so the taps'
         per-prompt host work weighs the most
  long   64 prompts of 1024 tokens (shipped prompts joined: h200.long_prompts), the workload of the eager-mode GPU
         benchmark (docs/benchmarks.md "GPU")
Per workload: each selection's first compare timed on its own (it compiles the tap reduction), one warm-up, then
--reps rounds of the interleaved compares, each with host CPU, GC and allocator counts (h200.CompareDiagnostics);
then the same rounds of the engine's part of a compare alone (its batches scored, taps read and dropped): the engine's
own share, where idle tap points cost. Then, one engine at a time: a cProfile and the device's kernel table of the
engine's part of a taps-none compare (ENGINE-engine-profile-WORKLOAD.txt, both engines), and on the tapped engine the
anatomy (benchmarks/tap_anatomy.py: the run loop with its parts switched on one at a time) with a cProfile of one
tapped compare (tapped-profile-WORKLOAD.txt), and the torch.profiler kernel tables of one taps-all and one taps-none
compare (device-profile-WORKLOAD-TAPS.txt: the difference is what taps cost the device). OUT/plain.json and
OUT/tapped.json hold each engine's numbers, OUT/tap-cost.json the ratios: taps all on the tapped engine over taps none
on the plain engine (what a user pays), and taps none on the tapped engine over the plain engine (what idle tap points
cost), on medians and on the fastest calls.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "benchmarks"))  # what follows lives in benchmarks/
from h200 import CompareDiagnostics, add_workload_arguments, device_profile, long_prompts, timed
from tap_anatomy import anatomy

PRESETS = ("qwen2.5-1.5b", "qwen3-1.7b", "tiny")  # tiny: a CPU dry run
# Room for the training model and one batch of taps beside the engine; the fixed KV cache skips the memory profiling
# that would count a neighbouring process's allocations (README, --build-ahead).
ENGINE_ARGS = {"gpu_memory_utilization": 0.3, "kv_cache_memory_bytes": 8 * 10**9}
SHORT_PROMPTS, LONG_PROMPTS, LONG_TOKENS = 16, 64, 1024


def _profile(probe, path, **opts) -> None:
    profiler = cProfile.Profile()
    profiler.runcall(probe.compare, taps="all", **opts)
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats("divergence_probe", 45)
    path.write_text(text.getvalue())


def _engine_calls(probe, prompts, taps: str):
    """The inference side of a compare alone: its batches scored by the engine, the taps read and dropped."""
    from divergence_probe.compare import capturable_taps
    from divergence_probe.prompts import batches

    wanted = capturable_taps(probe, probe._spec("compare", None, {"taps": taps}))[0] if taps != "none" else frozenset()
    groups = list(batches(prompts, probe.settings.batch_tokens, probe.infer.max_sequences_per_step))
    return lambda: [probe.infer.score(group, wanted, lambda *_: None) for group in groups]


def _profile_engine(probe, prompts, path) -> None:
    """cProfile and, on a GPU, the device's kernel table of the engine's part of one taps-none compare: what idle tap
    points cost, by function and by kernel."""
    call = _engine_calls(probe, prompts, "none")
    profiler = cProfile.Profile()
    profiler.runcall(call)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
    if torch.cuda.is_available():
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            timed(call)
        events = prof.key_averages()
        text.write(events.table(sort_by="self_device_time_total", row_limit=45))
        text.write(events.table(sort_by="self_cpu_time_total", row_limit=30))
    path.write_text(text.getvalue())


class _Engine:
    """One engine and its training stack, in a process of its own, run call by call by the driving process
    (`serve`): each call's numbers go back to it."""

    def __init__(self, args) -> None:
        import divergence_probe as dp
        from divergence_probe.prompts import default_prompts_path, load_prompts

        self.args, self.tapped = args, args.serve == "tapped"
        engine_args = {} if args.device == "cpu" else ENGINE_ARGS
        self.probe, load_s = timed(lambda: dp.load(str(args.models_dir / args.preset), device=args.device,
                                                   engine="compiled", engine_args=engine_args,
                                                   taps="all" if self.tapped else None))
        probe = self.probe
        settings = probe.infer.info().settings
        long_path = long_prompts(probe.tokenizer, probe.settings.max_model_len, LONG_PROMPTS, LONG_TOKENS,
                                 args.out / f"{args.serve}-long.jsonl")
        self.options = {"short": dict(prompts=default_prompts_path(), num_prompts=SHORT_PROMPTS,
                                      max_prompt_tokens=1024),
                        "long": dict(prompts=long_path, max_prompt_tokens=LONG_TOKENS)}
        self.prompts = {name: load_prompts(opts["prompts"], probe.tokenizer, max_prompt_tokens=opts["max_prompt_tokens"],
                                           max_model_len=probe.settings.max_model_len)[: opts.get("num_prompts")]
                        for name, opts in self.options.items()}
        self.engine_calls = {}
        self.diagnostics = CompareDiagnostics()
        self.header = {
            "part": args.serve, "preset": args.preset, "load_s": load_s, "engine_args": engine_args,
            "cudagraph_mode": settings["compilation"]["cudagraph_mode"], "tap_buffer_bytes": settings["tap_buffer_bytes"],
            "cudagraph_capture_sizes": settings["compilation"]["cudagraph_capture_sizes"],
            "max_num_batched_tokens": settings["max_num_batched_tokens"],
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}

    def call(self, op: str, workload: str | None = None, taps: str | None = None) -> dict:
        opts = self.options.get(workload)
        if op == "size":
            prompts = self.prompts[workload]
            return {"prompts": len(prompts), "scored_tokens": sum(len(p.token_ids) - 1 for p in prompts)}
        if op == "first":
            return {"seconds": timed(lambda: self.probe.compare(taps=taps, **opts))[1]}
        if op == "warm":
            self.probe.compare(taps=taps, **opts)
            key = (workload, taps)
            self.engine_calls[key] = _engine_calls(self.probe, self.prompts[workload], taps)
            self.engine_calls[key]()
            return {}
        if op == "compare":
            _, seconds, diag = self.diagnostics.measure(lambda: self.probe.compare(taps=taps, **opts))
            return {"seconds": seconds, "diag": {"taps": taps, **diag}}
        if op == "engine":
            return {"seconds": timed(self.engine_calls[(workload, taps)])[1]}
        if op == "profiles":
            return self._profiles(workload)
        if op == "finish":
            from divergence_probe.fused import backend

            return {"tap_reduction": backend()}
        raise ValueError(f"unknown call {op!r}")

    def _profiles(self, workload: str) -> dict:
        found = {}
        if "engine" in self.args.profiles:
            _profile_engine(self.probe, self.prompts[workload],
                            self.args.out / f"{self.args.serve}-engine-profile-{workload}.txt")
        if self.tapped and "device" in self.args.profiles:
            found["device_profile"] = {
                taps: device_profile(self.probe, self.args.out / f"device-profile-{workload}-{taps}.txt", taps=taps,
                                     **self.options[workload])
                for taps in ("all", "none")}
        if self.tapped and workload in self.args.anatomy:
            found["anatomy_s"] = anatomy(self.probe, self.prompts[workload], rounds=2)
            _profile(self.probe, self.args.out / f"tapped-profile-{workload}.txt", **self.options[workload])
        return found


REPLY = "@@tap-cost "  # marks the driver's replies on a child's stdout, where vLLM may print too


def serve(args) -> None:
    """A child: load one engine, then run the driver's calls (one JSON object per stdin line), replying on stdout."""
    if args.cores:  # before vLLM and torch start their threads
        cores = [int(c) for c in args.cores.split(",")]
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))
    engine = _Engine(args)
    engine.header["cores"] = sorted(os.sched_getaffinity(0))
    print(REPLY + json.dumps(engine.header), flush=True)
    for line in sys.stdin:
        print(REPLY + json.dumps(engine.call(**json.loads(line))), flush=True)
    os._exit(0)  # vLLM's teardown at interpreter exit hung once on the H200


class _Child:
    """The driver's handle on one engine process."""

    def __init__(self, args, part: str, cores: list[int]) -> None:
        command = [sys.executable, __file__, "--serve", part, "--cores", ",".join(map(str, cores)), *sys.argv[1:]]
        self.part = part
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                        stderr=open(args.out / f"{part}.log", "w"))
        self.header = self._reply()

    def _reply(self) -> dict:
        for line in self.process.stdout:
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY):])
        raise RuntimeError(f"the {self.part} engine process ended (exit {self.process.wait()}); see its .log")

    def __call__(self, op: str, **kw) -> dict:
        self.process.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.process.stdin.flush()
        return self._reply()

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=120)


def drive(args) -> None:
    """Load the engines one after the other (a neighbour's compile would slow the other's load), then run every call,
    one at a time, the timed ones interleaved across the engines; write each engine's numbers and the summary."""
    from divergence_probe.modelzoo import make_model

    if not (args.models_dir / args.preset / "config.json").exists():
        make_model(args.models_dir / args.preset, preset=args.preset, seed=0)
    # Each engine process on cores of its own: a neighbour's threads then cannot slow the engine whose call is timed
    # (run G's plain calls were 0.48 s or 0.72 s from one call to the next, both engines on all 16 cores)
    cores = sorted(os.sched_getaffinity(0))
    share = max(1, len(cores) // len(args.parts))
    children = {part: _Child(args, part, cores[i * share : (i + 1) * share] or cores[-share:])
                for i, part in enumerate(args.parts)}
    results = {part: {**child.header, "workloads": {}} for part, child in children.items()}
    selections = {"plain": ("none",), "tapped": ("all", "none")}
    calls = [(part, taps) for part in args.parts for taps in selections[part]]
    for name in args.workloads:
        rows = {part: {**child("size", workload=name), "calls": [], "times_s": {}, "engine_s": {}}
                for part, child in children.items()}
        for part in children:  # the first compare of a process compiles the tap reduction: timed apart
            rows[part]["first_call_s"] = children[part]("first", workload=name, taps=selections[part][0])["seconds"]
        for part, taps in calls:
            children[part]("warm", workload=name, taps=taps)
        for op, into in (("compare", "times_s"), ("engine", "engine_s")):
            for rep in range(args.reps):  # rotated each round: no call always follows the same one
                for part, taps in calls[rep % len(calls):] + calls[: rep % len(calls)]:
                    reply = children[part](op, workload=name, taps=taps)
                    rows[part][into].setdefault(taps, []).append(reply["seconds"])
                    if "diag" in reply:
                        rows[part]["calls"].append(reply["diag"])
        for part in children:  # the timed calls first: a run cut short in the profiles keeps them
            results[part]["workloads"][name] = rows[part]
            (args.out / f"{part}.json").write_text(json.dumps(results[part], indent=2) + "\n")
        print(f"{name}: timed calls done", flush=True)
        for part, child in children.items():
            rows[part] |= child("profiles", workload=name)
            (args.out / f"{part}.json").write_text(json.dumps(results[part], indent=2) + "\n")
    for part, child in children.items():
        results[part] |= child("finish")
        (args.out / f"{part}.json").write_text(json.dumps(results[part], indent=2) + "\n")
        child.close()
    summary(args)


def summary(args) -> None:
    tapped = json.loads((args.out / "tapped.json").read_text())
    plain_json = args.out / "plain.json"
    plain = json.loads(plain_json.read_text()) if plain_json.exists() else None  # (a run of the tapped part alone)
    med = statistics.median
    result = {"preset": args.preset, "gpu": tapped["gpu"],
              "load_s": {"plain": plain and plain["load_s"], "tapped": tapped["load_s"]},
              "tap_reduction": tapped.get("tap_reduction"), "workloads": {}}
    for name, t in tapped["workloads"].items():
        all_s, none_s = t["times_s"]["all"], t["times_s"]["none"]
        row = result["workloads"][name] = {
            "prompts": t["prompts"], "scored_tokens": t["scored_tokens"],
            "median_s": {"tapped_none": med(none_s), "tapped_all": med(all_s)},
            # the same engine, taps none: interleaved in one process, the cleanest pairing
            "taps_all_over_taps_none": med(all_s) / med(none_s),
            "taps_all_over_taps_none_fastest": min(all_s) / min(none_s),
            "first_call_s": {"tapped_all": t["first_call_s"]},
            "anatomy_s": t.get("anatomy_s"),
            "engine_median_s": {f"tapped_{k}": med(v) for k, v in t.get("engine_s", {}).items()},
        }
        if plain is not None:  # against the engine without tap points (vLLM as deployed): what a user pays
            p = plain["workloads"][name]["times_s"]["none"]
            row["median_s"]["plain_none"] = med(p)
            rounds = sorted(a / b for a, b in zip(all_s, p))  # each round's two calls ran next to each other: the
            row |= {"taps_all_over_untapped_engine": med(all_s) / med(p),  # machine's drift cancels within a round
                    "taps_all_over_untapped_engine_fastest": min(all_s) / min(p),
                    "taps_all_over_untapped_engine_per_round": rounds,
                    "taps_all_over_untapped_engine_round_median": med(rounds),
                    "idle_tap_points": med(none_s) / med(p)}
            row["first_call_s"]["plain_none"] = plain["workloads"][name]["first_call_s"]
            if "engine_s" in plain["workloads"][name]:
                plain_engine = med(plain["workloads"][name]["engine_s"]["none"])
                row["engine_median_s"]["plain_none"] = plain_engine
                row["idle_tap_points_engine_alone"] = row["engine_median_s"]["tapped_none"] / plain_engine
    (args.out / "tap-cost.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=PRESETS, required=True)
    ap.add_argument("--reps", type=int, default=7, help="rounds of interleaved timed calls per workload")
    ap.add_argument("--workloads", default="short,long", type=lambda v: tuple(v.split(",")),
                    help="the workloads to time, in this order: short,long (default), or either alone")
    ap.add_argument("--parts", default="plain,tapped", type=lambda v: tuple(v.split(",")),
                    help="the engines to run: plain,tapped (default) or tapped alone (its taps all against taps none)")
    ap.add_argument("--anatomy", default="short,long", type=lambda v: set(v.split(",")) - {""},
                    help="the workloads to run the anatomy and cProfile on, on the tapped engine ('' for none)")
    ap.add_argument("--profiles", default="engine,device", type=lambda v: set(v.split(",")) - {""},
                    help="per workload, 'engine': profile the engine's part of a taps-none compare, both engines; "
                         "'device': the tapped engine's kernel table of a taps-all and a taps-none compare "
                         "('' none)")
    ap.add_argument("--serve", choices=("plain", "tapped"), help=argparse.SUPPRESS)  # a child of the driver
    ap.add_argument("--cores", help=argparse.SUPPRESS)  # the child's own CPU cores
    add_workload_arguments(ap)
    args = ap.parse_args()
    if not set(args.workloads) <= {"short", "long"}:
        ap.error("--workloads: short,long, short or long")
    if not set(args.parts) <= {"plain", "tapped"} or "tapped" not in args.parts:
        ap.error("--parts: plain,tapped or tapped")
    args.out.mkdir(parents=True, exist_ok=True)  # after the checks: a bad flag leaves no directory behind
    serve(args) if args.serve else drive(args)


if __name__ == "__main__":
    main()
