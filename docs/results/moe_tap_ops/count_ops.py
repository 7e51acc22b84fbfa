"""What the taps add to a MoE compare, counted rather than timed (a shared CPU's wall time is noise): torch ops and
host read-backs per compare, by where they run, and the routing capture's Python time.

    PYTHONPATH=$PWD .venv/bin/python docs/results/moe_tap_ops/count_ops.py OUT.json [--layers 2] [--prompts 24] \
        [--write RUN_DIR] [--accelerator-calls]

One load of the tiny Qwen3-MoE (modelzoo `tiny`, `--layers` deep), a warm-up compare of each kind, then one compare with
`--taps none` and one with `--taps all`, each counted three ways:
- `ops`: the profiler's top-level aten ops of the whole compare (torch.profiler, CPU; an op called by another op is not
  counted again), about the number of kernel launches the same run makes on a GPU;
- `routing_ops`: the ops dispatched inside the routing capture (route_capture.RouteCapture's methods, the tap pairing's
  own reduction that it calls excluded), counted by a TorchDispatchMode entered only there;
- `readbacks`: calls that read a tensor's values back to the host (item, tolist, cpu, numpy, bool/int/float of a
  tensor, nonzero, boolean-mask indexing): each is a device->host synchronisation on a GPU; by region (routing
  capture, tap pairing, elsewhere);
plus `routing_python_s`: the routing capture's cumulative time under cProfile (wall time: noise on a shared CPU).
`--write`: the taps-all run's files, to check outputs byte for byte before and after a change.
`--accelerator-calls`: the routing compared in the calls a GPU makes (route_capture.rows_per_call), to count its ops
on the CPU.
"""

from __future__ import annotations

import argparse
import cProfile
import contextlib
import json
import pstats
import tempfile
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import divergence_probe as dp
from divergence_probe import capture as tap_capture
from divergence_probe import route_capture
from divergence_probe.modelzoo import make_model

ROOT = Path(__file__).resolve().parents[3]
_region: list[str] = ["elsewhere"]
readbacks: Counter = Counter()
routing_ops: Counter = Counter()


class _Ops(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        routing_ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _in_region(name: str, fn):
    def wrapped(*args, **kwargs):
        _region.append(name)
        try:
            if name == "routing":
                with _Ops():
                    return fn(*args, **kwargs)
            with _disable_current_modes():  # the tap pairing's own ops, called from the routing capture: not counted
                return fn(*args, **kwargs)
        finally:
            _region.pop()
    return wrapped


def _counted(fn, what):
    def wrapped(self, *args, **kwargs):
        readbacks[(_region[-1], what)] += 1
        return fn(self, *args, **kwargs)
    return wrapped


def _getitem(fn):
    def wrapped(self, index):
        if isinstance(index, torch.Tensor) and index.dtype == torch.bool:
            readbacks[(_region[-1], "bool_index")] += 1
        return fn(self, index)
    return wrapped


@contextlib.contextmanager
def instrumented():
    saved = []

    def patch(owner, name, new):
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, new)

    for name in ("park", "pair", "finish_prompt", "add_sequences", "result"):
        patch(route_capture.RouteCapture, name, _in_region("routing", getattr(route_capture.RouteCapture, name)))
    for name in ("finish_prompt",):
        patch(tap_capture.TapPairing, name, _in_region("pairing", getattr(tap_capture.TapPairing, name)))
    for what in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "nonzero"):
        patch(torch.Tensor, what, _counted(getattr(torch.Tensor, what), what))
    patch(torch.Tensor, "__getitem__", _getitem(torch.Tensor.__getitem__))
    try:
        yield
    finally:
        for owner, name, old in reversed(saved):
            setattr(owner, name, old)


def count(probe, taps: str, prompts: int, write: Path | None) -> dict:
    readbacks.clear()
    routing_ops.clear()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, instrumented():
        run = probe.compare(num_prompts=prompts, taps=taps)
    top = [e for e in prof.events() if e.name.startswith("aten::")
           and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::"))]
    profile = cProfile.Profile()
    profile.enable()
    probe.compare(num_prompts=prompts, taps=taps)
    profile.disable()
    stats = pstats.Stats(profile).stats
    routing_s = sum(ct for (file, _, fn), (_, _, _, ct, _) in stats.items()
                    if file.endswith("route_capture.py") and fn in ("finish_prompt", "result", "park", "pair"))
    pairing_s = sum(ct for (file, _, fn), (_, _, _, ct, _) in stats.items()
                    if file.endswith("capture.py") and not file.endswith("route_capture.py") and fn == "finish_prompt")
    if write is not None:
        run.write(write)
    by_region = Counter()
    for (region, _), n in readbacks.items():
        by_region[region] += n
    return {"taps": taps, "ops": len(top), "ops_top": dict(Counter(e.name for e in top).most_common(15)),
            "routing_ops": sum(routing_ops.values()),
            "routing_ops_top": dict(routing_ops.most_common(12)),
            "readbacks": dict(by_region),
            "readbacks_by_call": {f"{r}:{w}": n for (r, w), n in sorted(readbacks.items())},
            "routing_python_s": round(routing_s - pairing_s, 3),
            "routing_python_s_note": "route_capture's park/pair/finish_prompt/result, cumulative, less the tap "
                                     f"pairing's finish_prompt that it calls ({pairing_s:.3f} s)"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--write", type=Path)
    parser.add_argument("--accelerator-calls", action="store_true",
                        help="compare routing in the calls an accelerator makes (route_capture.rows_per_call), not "
                             "the CPU's: the ops a GPU would launch")
    a = parser.parse_args()
    if a.accelerator_calls:
        route_capture.rows_per_call = lambda logits, top_k: route_capture.ROWS_PER_CALL
    model = make_model(Path(tempfile.mkdtemp()) / "moe", arch="qwen3_moe", preset="tiny", seed=0, num_layers=a.layers)
    probe = dp.load(str(model), infer="vllm", dtype="bfloat16", device="cpu")
    for taps in ("none", "all"):
        probe.compare(num_prompts=a.prompts, taps=taps)  # warm-up: compiled reductions, first-call caches
    runs = [count(probe, t, a.prompts, a.write if t == "all" else None) for t in ("none", "all")]
    result = {"layers": a.layers, "prompts": a.prompts, "accelerator_calls": a.accelerator_calls, "runs": runs}
    probe.close()
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
