"""A vLLM engine in a worker process, used as an inference stack: for an engine this process cannot build.

vLLM's CPU backend hosts one engine per process and a compiled engine cannot take a region patch once built, so an
engine with other regions aligned (`aligned`), or in the other engine mode (the engine-mode noise floor),
runs in a child process of its own: `WorkerStack` starts it, proxies the Stack calls the run loop makes (score,
score_batched, sample, info) and replays the taps and scores it returns, so `compare.score_both` runs unchanged.

Protocol: requests and results are torch.save files in a private temp folder; one line on the child's stdin names a
request, one JSON line on its protocol channel (its original stdout; vLLM's own output goes to a log) answers it.
The child is started with the parent's `divergence_probe` on its path, so both run the same code.

    python -m divergence_probe.engines.vllm.worker FOLDER      (FOLDER/init.pt: settings and regions)
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Iterator, Sequence

import torch

from ...errors import StackError
from ...prompts import Prompt, batches
from ...signals import forget, pass_on_to
from ..elapsed import Elapsed
from ..peak import PeakMemory
from ..protocol import (PATCH_AT_BUILD, PATCH_ONCE_LOADED, Capabilities, PromptScores, SamplingSpec, ScoresSink,
                        SequenceScores, StackInfo, StackSettings, TapSink)
from .aligned import cache_namespace
from .knobs import tap_meanings
from .policy import VLLMPolicy
from .stack import VLLMStack

LOG_TAIL = 2000  # characters of the child's log quoted when it dies
STOP_SECONDS = 30  # how long a child may take to stop (SIGTERM unwinds its engine build) before it is killed
ENGINE_CALLS = ("score", "score_batched", "sample")  # the calls the child times around its engine (step_time)


class WorkerStack(VLLMPolicy):
    """The `vllm` stack, run by a child process with `regions` aligned in its engine before it was built."""

    _proc: subprocess.Popen | None = None  # the child, once started; None too for a worker whose __init__ refused

    def __init__(self, settings: StackSettings, regions: Sequence[str] = ()) -> None:
        if settings.device == "cuda" and "gpu_memory_utilization" not in settings.engine_kwargs():
            # each engine reserves its fraction of the whole GPU at start: two at the default do not fit one card
            raise StackError("a second vLLM engine (a worker for an aligned compiled engine or --engine-noise) must "
                             "share the GPU with this run's engine; pass --engine-args '{\"gpu_memory_utilization\": "
                             "0.3}' (both engines get it)")
        self.settings, self.regions = settings, tuple(regions)
        self.recompute_gap = 0.0  # the probe resets it per run; the child's own value is in info()
        # regions patched into an eager engine around each call, beside those it was built with: one eager worker then
        # serves every engine-side combination of an ablation run with --placement alternate (runs/alternate.py)
        self.patched: tuple[str, ...] = ()
        self._folder = Path(tempfile.mkdtemp(prefix="divergence-probe-engine-"))
        self._calls = 0
        self._engine_seconds = 0.0  # the time the child's engine spent in the calls so far, timed in the child
        self._idle = False  # True while the child waits for a request: only then does it read "close"
        self.build_seconds = float("nan")
        self._status: dict = {}
        self._namespace: str | None = None  # this aligned build's own compile cache root (start() sets it)

    # ------------------------------------------------------------------------------------------- lifecycle
    def start(self) -> "WorkerStack":
        """Start the child (it builds its engine); `wait_ready` blocks until the engine is built. Split so a caller
        can start the next engine while this process still works on something else."""
        torch.save({"settings": self.settings, "regions": self.regions}, self._folder / "init.pt")
        package_root = str(Path(__file__).resolve().parents[3])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        for name in ("VLLM_CACHE_ROOT", "XDG_CACHE_HOME", "TORCHINDUCTOR_CACHE_DIR", "HF_HOME", "DP_ENGINE_LOG"):
            if env.get(name):  # the child runs in its temp folder: a relative path would point into it
                env[name] = os.path.abspath(env[name])
        namespace = cache_namespace(self.regions) if self.settings.engine == "compiled" else None
        if namespace is not None:
            env["VLLM_CACHE_ROOT"] = namespace
        self._namespace = namespace
        self.cache_root = namespace or env.get("VLLM_CACHE_ROOT")
        self._log = open(self._folder / "engine.log", "wb")
        self._started = time.perf_counter()
        self._proc = subprocess.Popen([sys.executable, "-m", "divergence_probe.engines.vllm.worker", str(self._folder)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=env,
                                      cwd=self._folder)
        pass_on_to(self._proc)  # a SIGTERM to this process stops every worker at once, whatever it is doing
        return self

    def wait_ready(self) -> "WorkerStack":
        try:
            self._status = self._answer("build")
        except StackError as e:
            if self._namespace is None:
                raise
            # A failed aligned build may have saved a graph compiled without its regions (a start that never reached
            # the patch, or a check that found the regions missing): a later build of this region set would load it.
            shutil.rmtree(self._namespace, ignore_errors=True)
            raise StackError(f"{e}; the compile cache of this region set ({self._namespace}) was removed, so a rerun "
                             "compiles afresh") from e
        self.build_seconds = time.perf_counter() - self._started
        self._idle = True
        return self

    def load(self, settings: StackSettings) -> None:
        """The Stack protocol's load: start the child and wait until its engine is built."""
        if settings != self.settings:
            raise StackError("a WorkerStack is loaded with the settings it was made with")
        if self._proc is None:
            self.start()
        self.wait_ready()

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                if proc.poll() is None:
                    if self._idle:
                        proc.stdin.write(b"close\n")
                        proc.stdin.flush()
                    else:  # building its engine or inside a call (a run stopped or failed meanwhile): it would read
                        proc.terminate()  # "close" only once done; SIGTERM unwinds it now, its cleanups included
                    proc.wait(timeout=STOP_SECONDS)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()  # its own cleanups do not run: vLLM's rendezvous file may be left in the temp folder
                proc.wait()
            forget(proc)
            self._log.close()
        try:
            keep = os.environ.get("DP_ENGINE_LOG")
            if keep and (self._folder / "engine.log").exists():  # the child's log (vLLM's output), one file per engine
                suffix = "+".join(self.regions) or "shipped"
                with contextlib.suppress(OSError):  # a log that cannot be kept must not hide the run's own error
                    shutil.copyfile(self._folder / "engine.log", f"{keep}.{self.settings.engine}-{suffix}")
        finally:
            shutil.rmtree(self._folder, ignore_errors=True)

    def __enter__(self) -> "WorkerStack":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:  # a run that raised before close(): never leave an engine process behind
        if self._proc is not None:
            try:
                self.close()
            except Exception:  # at interpreter exit the modules close() needs may be gone; the child sees EOF
                pass

    # ------------------------------------------------------------------------------------------- calls
    def _answer(self, what: str) -> dict:
        """Read the child's answer line; a dead or failed child is a StackError naming what it said."""
        line = self._proc.stdout.readline()
        if not line:
            self._proc.wait()
            self._log.flush()
            tail = (self._folder / "engine.log").read_text(errors="replace")[-LOG_TAIL:].strip().splitlines()
            last = tail[-1] if tail else "no output"
            raise StackError(f"the {self._describe()} worker died during {what} (exit code {self._proc.returncode}; "
                             f"last line: {last}); set DP_ENGINE_LOG=PREFIX to keep each engine's log as "
                             "PREFIX.<mode>-<regions>, or use --engine eager")
        answer = json.loads(line)
        if "error" in answer:
            raise StackError(f"{self._describe()} worker: {answer['error']}")
        return answer

    def _describe(self) -> str:
        aligned = f"{'+'.join(self.regions)} aligned" if self.regions else "shipped"
        return f"vLLM engine ({self.settings.engine}, {aligned})"

    def _call(self, method: str, *args, patched: Sequence[str] = ()):
        if self._proc is None:
            raise StackError("the engine worker is not running (closed, or never started)")
        self._calls += 1
        name = f"call-{self._calls}"
        torch.save({"method": method, "args": args, "patched": tuple(patched)}, self._folder / f"{name}.pt")
        self._idle = False
        self._proc.stdin.write(f"{name}\n".encode())
        self._proc.stdin.flush()
        self._answer(method)
        self._idle = True
        result = torch.load(self._folder / f"{name}.out.pt", weights_only=False)
        for suffix in (".pt", ".out.pt"):
            (self._folder / f"{name}{suffix}").unlink(missing_ok=True)
        if method in ENGINE_CALLS:
            self._engine_seconds += result["seconds"]
        return result

    def score(self, prompts, taps: frozenset[str], sink: TapSink, on_scored: ScoresSink | None = None) -> list[PromptScores]:
        result = self._call("score", list(prompts), frozenset(taps), patched=self.patched)
        for prompt_id, key, x in result["taps"]:
            sink(prompt_id, key, x)
        self.recompute_gap = max(self.recompute_gap, result["recompute_gap"])
        if on_scored is None:
            return result["scores"]
        for scores in result["scores"]:
            on_scored(scores)
        return []

    def score_batched(self, prompts, taps: frozenset[str] = frozenset(), sink: TapSink | None = None
                      ) -> list[PromptScores]:
        result = self._call("score_batched", list(prompts), frozenset(taps), patched=self.patched)
        for prompt_id, key, x in result["taps"] if sink is not None else ():
            sink(prompt_id, key, x)
        return result["scores"]

    def sample(self, prompts, spec: SamplingSpec, taps: frozenset[str], sink: TapSink) -> list[SequenceScores]:
        result = self._call("sample", list(prompts), spec, frozenset(taps), patched=self.patched)
        for seq_id, key, x in result["taps"]:
            sink(seq_id, key, x)
        self.recompute_gap = max(self.recompute_gap, result["recompute_gap"])
        return result["scores"]

    def info(self) -> StackInfo:
        info, peak = self._call("info")
        info.settings["captured_logits_vs_reported_logprobs_max_gap"] = self.recompute_gap
        info.settings["engine_process"] = {
            "worker": "a child process of its own (one engine per process; built with these regions before it compiled)",
            "regions_aligned": list(self.regions),
            "regions": self._status.get("regions", {}),
            "vllm_cache_root": self.cache_root,
            "build_seconds": self.build_seconds,
            "device_peak": peak,
        }
        return info

    @contextlib.contextmanager
    def peak_memory(self) -> Iterator[PeakMemory]:
        """The child's peak over the calls made in the block, above what it held when the block began: its device
        allocator's, reset and read by the child (its info()'s device_peak is then the peak since this block); on the
        CPU its resident set, sampled from here."""
        if not self.settings.device.startswith("cuda"):
            with PeakMemory("cpu", pid=self._proc.pid).measuring() as meter:
                yield meter
            return
        meter = PeakMemory(self.settings.device, pid=self._proc.pid)
        before = self._call("memory", True)
        yield meter
        meter.peak = float(self._call("memory", False) - before)

    @contextlib.contextmanager
    def step_time(self) -> Iterator[Elapsed]:
        """The time the child's engine spent in the calls made in the block, timed in the child around each engine
        call (after a device synchronize on a GPU): the time an engine in this process takes, without the hand-over
        of the results (every position's logits) to this process, which grows with the vocabulary."""
        meter = Elapsed(self.settings.device)
        before = self._engine_seconds
        yield meter
        meter.seconds = self._engine_seconds - before

    @classmethod
    def declare(cls, engine: str = "eager", ranks: int = 1) -> Capabilities:
        """The engine's own, with its regions built in: nothing is patched into it from this process, and its routes
        stay in the child."""
        declared = VLLMStack.declare(engine)
        return replace(declared, patch=PATCH_AT_BUILD, records_routes=False, own_process=True, refused={
            **declared.refused,
            PATCH_ONCE_LOADED: "an engine in a worker process has its regions built in; start another worker for "
                               "others"})

    def capabilities(self) -> Capabilities:
        """What the child's engine reported once built: its taps and its scheduler's limit."""
        return replace(self.declare(self.settings.engine), taps=self._status["tap_status"],
                       max_sequences_per_step=self.max_sequences_per_step,
                       tap_meanings=tap_meanings(self.settings.engine_kwargs()))

    def begin_run(self) -> None:
        self.recompute_gap = 0.0

    @property
    def max_sequences_per_step(self) -> int:
        return self._status["max_sequences_per_step"]

    def batch_groups(self, prompts) -> list[list[Prompt]]:
        """How score_batched groups prompts into engine steps (as the worker's engine does)."""
        return list(batches(prompts, self.settings.batch_tokens, self.max_sequences_per_step))


# ----------------------------------------------------------------------------------------------- the child
def _serve(folder: Path) -> None:
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM's and torch's prints go to the log, never into the protocol

    def reply(**answer) -> None:
        protocol.write(json.dumps(answer) + "\n")

    init = torch.load(folder / "init.pt", weights_only=False)
    try:
        from .aligned import load_aligned
        from .engine_start import _disable_flashinfer_sampler_if_missing
        from .stack import _import_vllm

        _import_vllm()
        if init["settings"].device == "cuda":  # before load_aligned imports the runners (V2 binds the sampler then)
            _disable_flashinfer_sampler_if_missing()
        stack = load_aligned(VLLMStack(), init["settings"], init["regions"])
    except Exception as e:  # a StackError says what to do; anything else is vLLM failing to start
        traceback.print_exc()  # into the worker's log (DP_ENGINE_LOG), where a seam bug can be diagnosed
        reply(error=str(e).splitlines()[0] if str(e) else type(e).__name__)
        return
    reply(ok=True, regions=stack.aligned_in_engine, tap_status=dict(stack.capabilities().taps),
          max_sequences_per_step=stack.max_sequences_per_step)
    for line in sys.stdin:
        name = line.strip()
        if name == "close" or not name:
            break
        request = torch.load(folder / f"{name}.pt", weights_only=False)
        try:
            with contextlib.ExitStack() as patches:
                if request.get("patched"):
                    from ..patching import aligned

                    patches.enter_context(aligned([stack], request["patched"]))  # a compiled engine refuses
                result = _run(stack, request["method"], request["args"])
        except Exception as e:
            traceback.print_exc()
            reply(error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            continue
        torch.save(result, folder / f"{name}.out.pt")
        reply(ok=True)
    stack.close()


def _device_peak(device: str) -> dict | None:
    """The most torch's allocator held in this process on the device so far (weights, KV cache, activations, CUDA
    graph pools; not the CUDA context or library workspaces): the engine's side of a memory plan, which the parent's
    own counters cannot see."""
    if device != "cuda" or not torch.cuda.is_initialized():
        return None
    return {"max_reserved_bytes": int(torch.cuda.max_memory_reserved()),
            "max_allocated_bytes": int(torch.cuda.max_memory_allocated())}


def _run(stack, method: str, args: tuple):
    taps: list = []

    def sink(key, tap, x):  # kept past the call (base.TapSink), and a view would be saved with all of its storage
        taps.append((key, tap, x.clone(memory_format=torch.contiguous_format)))

    stack.recompute_gap = 0.0
    if method in ENGINE_CALLS:  # (prompts, [spec,] taps), the sink last: timed here, where the engine runs
        with Elapsed(stack.settings.device).timing() as clock:
            scores = getattr(stack, method)(*args, sink)
        return {"scores": scores, "taps": taps, "recompute_gap": stack.recompute_gap, "seconds": clock.seconds}
    if method == "info":
        return stack.info(), _device_peak(stack.settings.device)
    if method == "memory":  # (reset,): reset the allocator's peak and return what it holds, or return its peak
        torch.cuda.synchronize()
        if args[0]:
            torch.cuda.reset_peak_memory_stats()
            return int(torch.cuda.memory_allocated())
        return int(torch.cuda.max_memory_allocated())
    raise StackError(f"unknown engine worker call {method!r}")


if __name__ == "__main__":
    from ...signals import stop_on_signals

    # SIGTERM (the parent's close while this child builds its engine or serves a call) unwinds like Ctrl-C: vLLM's
    # start-up and the atexit cleanups run, so its rendezvous file (vllm_dist_*) does not outlive it
    with stop_on_signals():
        _serve(Path(sys.argv[1]))
