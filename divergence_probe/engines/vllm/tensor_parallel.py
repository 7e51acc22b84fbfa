"""vLLM at `tensor_parallel_size` N > 1, as the inference stack: taps captured in every rank, gathered, shipped back.

    divergence-probe compare --model M --engine-args '{"tensor_parallel_size": 2}' --taps all

At N > 1 the model lives in N worker processes vLLM spawns (its multiprocessing executor), not in this one, so the
in-process hooks of stack.py cannot reach it. `llm.collective_rpc(fn)` runs `fn(worker)` in every rank: before each
engine step, every rank installs the very capture stack.py runs in-process (`VLLMStack._capture`: the same seams, the
same step layout, the same logits seam) on its shard of the model; after the step, every rank hands back what it
kept, and this process joins it into unsharded taps. Which taps are a rank's shard and which are whole in every rank
is the family's data (models/: `Family.column_parallel`): a column-parallel GEMM's output (q/k/v, gate/up) and what
stays per head or per feature after it (RoPE, attention, SwiGLU) hold the rank's slice of the features, in rank
order; a row-parallel GEMM's output (o_proj, down_proj) is all-reduced inside vLLM, so it and everything on the
residual stream is the same in every rank and is taken from rank 0. When a model has fewer KV heads than ranks, vLLM
gives several ranks the same KV head: only one rank per KV head is joined. vLLM all-gathers the logits in every rank
(`LogitsProcessor._gather_logits` on every platform but TPU), so rank 0's are the whole vocabulary, and the
logprobs checked against them are vLLM's own.

What this cannot do (`REFUSED`, declared in TensorParallelStack's Capabilities, which spec.check_family and rl refuse
before loading): a compiled engine (its tap
points would live in each rank's graph: not built), regions patched into the engine, --graft/--depth (they feed the
engine's own inputs to single modules), --mode generate, rl, and mixture-of-experts families (models/qwen3_moe.py:
the routes of every rank are not gathered).

On the CPU build every rank needs its own cores: vLLM's auto-binding asserts one NUMA node per rank, so unless
VLLM_CPU_OMP_THREADS_BIND is set, this process's cores are split evenly between the ranks ("0|1" on two cores).
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import replace
from typing import Sequence

import torch

from ...errors import StackError, one_line
from ...models import get_family
from ...taps import TapKey
from ..protocol import ENGINE_REGIONS, PATCH_NEVER, PATCH_ONCE_LOADED, Capabilities, StackInfo, StackSettings
from .policy import ranks_of
from .stack import SUPPORTED_MODEL_CLASSES, VLLMStack
from .step import _Step

# What cannot run sharded, by spec.check_family's feature names, and why (the one-line refusal says it).
REFUSED = {
    "--engine compiled": "a compiled engine's tap points would live in every rank's graph, which is not built; use "
                         "--engine eager",
    "--graft": "it runs training-stack ops on the engine's inputs of single modules, which are shards in worker "
               "processes; run it at tensor_parallel_size 1",
    "--depth": "it continues the trainer from the engine's residual stream as one in-process engine hands it over; "
               "run it at tensor_parallel_size 1",
    ENGINE_REGIONS: "they are patched into the engine's modules, which live in worker processes; use --side train "
                    "(the engine as deployed) or tensor_parallel_size 1",
    "--mode generate": "the decode path's per-step capture is not built for worker processes; use --mode prefill or "
                       "tensor_parallel_size 1",
    "rl": "it pushes the trainer's weights into the engine's model in this process; run it at tensor_parallel_size 1",
}


@contextlib.contextmanager
def _cores_bound(settings: StackSettings):
    """vLLM CPU: while the engine starts its ranks, VLLM_CPU_OMP_THREADS_BIND splits this process's cores evenly
    between them, unless the user set it; restored afterwards, so that a later engine (the parallelism floor's, in a
    worker process) is bound as it would be alone. Yields the binding the ranks got."""
    name, before = "VLLM_CPU_OMP_THREADS_BIND", os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    if settings.device != "cpu" or before:
        yield before if settings.device == "cpu" else None
        return
    ranks, cores = ranks_of(settings.engine_kwargs()), sorted(os.sched_getaffinity(0))
    if len(cores) < ranks:
        raise StackError(f"tensor_parallel_size {ranks} on the CPU needs a core per rank, and this process has "
                         f"{len(cores)}; lower tensor_parallel_size")
    per = len(cores) // ranks
    os.environ[name] = "|".join(",".join(map(str, cores[r * per : (r + 1) * per])) for r in range(ranks))
    try:
        yield os.environ[name]
    finally:
        del os.environ[name]


# ------------------------------------------------------------------------------------------ in every rank
_LIVE: dict = {}  # this rank's capture of the step being run: hooks, step layout, kept taps, prompts, rank


def _rank_stack(worker, settings):
    stack = VLLMStack()
    stack.settings = settings
    stack._attach(worker.model_runner)
    return stack


def _describe(worker, settings) -> dict:
    """Rank side of load: the model class, its layers, and the implementations stack.py's info reads."""
    from vllm.distributed import get_tensor_model_parallel_rank

    stack = _rank_stack(worker, settings)
    return {"rank": get_tensor_model_parallel_rank(), "model_class": type(stack.model).__name__,
            "layers": len(stack.layers), "implementations": stack.implementations(),
            "model_runner": f"{type(stack.runner).__module__}.{type(stack.runner).__qualname__}"}


def _install(worker, settings, prompts, taps, keep) -> int:
    """Rank side, before a step: stack.py's capture on this rank's model; taps named in `keep` (or every tap, in
    rank 0) are copied to the host as they come, the rest dropped (rank 0 has them whole)."""
    from vllm.distributed import get_tensor_model_parallel_rank

    if _LIVE:  # a step that failed before it was collected: its hooks go first
        _LIVE.pop("hooks").remove()
        _LIVE.clear()
    rank = get_tensor_model_parallel_rank()
    stack, step, kept = _rank_stack(worker, settings), _Step(), []

    def sink(prompt_id, key, x):
        if rank == 0 or key.name in keep:
            kept.append((prompt_id, key, x.to("cpu", copy=True)))

    _LIVE.update(hooks=stack._capture(prompts, taps, sink, step), step=step, kept=kept, prompts=prompts, rank=rank)
    return rank


def _collect(worker) -> dict:
    """Rank side, after the step: remove the capture; this rank's kept taps and (rank 0) each prompt's logits."""
    if not _LIVE:
        raise StackError("no capture is installed in this rank")
    live = dict(_LIVE)
    _LIVE.clear()
    live["hooks"].remove()
    logits = {}
    if live["rank"] == 0:
        for p in live["prompts"]:
            logits[p.prompt_id] = live["step"].logits(p.prompt_id, len(p.token_ids)).to("cpu", copy=True)
    return {"rank": live["rank"], "taps": live["kept"], "logits": logits}


# ------------------------------------------------------------------------------------------ in this process
def gather(ranks: Sequence[dict], family, kv_replicas: int) -> list[tuple[int, TapKey, torch.Tensor]]:
    """Every rank's kept taps -> (prompt_id, key, unsharded tensor), in rank 0's order. A column-parallel tap is its
    ranks' slices joined along the features in rank order (of KV-width taps, one rank per KV head: every
    `kv_replicas`-th); any other tap is rank 0's."""
    ranks = sorted(ranks, key=lambda r: r["rank"])
    shards = [{(pid, key): x for pid, key, x in r["taps"]} for r in ranks]
    out = []
    for pid, key, x in ranks[0]["taps"]:
        if key.name in family.column_parallel:
            step = kv_replicas if family.widths.get(key.name) == "kv" else 1
            try:
                x = torch.cat([shards[r][(pid, key)] for r in range(0, len(ranks), step)], dim=-1)
            except KeyError as e:
                raise StackError(f"tap {key.label} of prompt {pid} came from rank 0 but not from every rank; "
                                 "a rank's capture seam moved: report this as a bug") from e
        out.append((pid, key, x))
    return out


class TensorParallelStack(VLLMStack):
    """The `vllm` stack at tensor_parallel_size > 1 (module docstring): the engine's driver here, its model in the
    ranks."""

    @classmethod
    def declare(cls, engine: str = "eager", ranks: int = 2) -> Capabilities:
        """The engine's own, less what cannot run sharded (REFUSED); no region patch reaches the ranks' modules, and
        the routes of every rank are not gathered."""
        declared = super().declare(engine)
        sharded = {feature: f"{feature} cannot run at tensor_parallel_size {ranks}: {why}"
                   for feature, why in REFUSED.items()}
        return replace(declared, refused={**declared.refused, **sharded, PATCH_ONCE_LOADED: sharded[ENGINE_REGIONS]},
                       patch=PATCH_NEVER, records_routes=False)

    def _ranks(self) -> int:
        return ranks_of(self.settings.engine_kwargs())

    def load(self, settings: StackSettings) -> None:
        with _cores_bound(settings) as self._binding:
            super().load(settings)

    def _attach(self, runner=None) -> None:
        """No model in this process: every rank describes its own (the model class is checked as stack.py does)."""
        described = min(self._rpc(_describe, self.settings), key=lambda d: d["rank"])
        self.runner = self.model = None
        self._described = described
        if described["model_class"] not in SUPPORTED_MODEL_CLASSES:
            raise StackError(f"vLLM loaded {described['model_class']}; supported: {', '.join(SUPPORTED_MODEL_CLASSES)}")

    def _rpc(self, fn, *args) -> list:
        try:
            return self.llm.collective_rpc(fn, args=args)
        except Exception as e:  # a rank raised or died: one line with the rank's own message
            said = one_line(e)
            # vLLM 0.32 wraps it: "Worker failed with error '<message>', please check the stack trace above ..."
            said = re.sub(r"^Worker failed with error '(.*)', please check the stack trace above.*$", r"\1", said)
            raise StackError(f"a vLLM tensor-parallel rank failed in {fn.__name__.strip('_')}: {said}") from e

    @property
    def num_layers(self) -> int:
        return self._described["layers"]

    def implementations(self) -> dict[str, str]:
        return self._described["implementations"]

    def _family_and_replicas(self):
        """The model's family, and how many ranks share one KV head (1 when every rank has KV heads of its own)."""
        config = self.llm.llm_engine.vllm_config.model_config.hf_config
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return get_family(config.model_type), max(1, ranks_of(self.settings.engine_kwargs()) // kv_heads)

    def _run_step(self, prompts, taps, sink, requests, params):
        """One engine step with every rank capturing; the gathered taps to `sink`, rank 0's logits returned."""
        family, replicas = self._family_and_replicas()
        self._rpc(_install, self.settings, list(prompts), frozenset(taps), frozenset(taps) & family.column_parallel)
        try:
            outputs = self._generate(requests, params)
        except BaseException:
            with contextlib.suppress(StackError):  # the ranks' hooks go; the step's own error is the one to report
                self._rpc(_collect)
            raise
        ranks = self._rpc(_collect)
        device = self.settings.device
        for prompt_id, key, x in gather(ranks, family, replicas):
            sink(prompt_id, key, x.to(device))
        logits = min(ranks, key=lambda r: r["rank"])["logits"]
        return outputs, lambda prompt_id, length: logits[prompt_id].to(device)

    def _generate(self, requests, params):
        try:
            return self.llm.generate(requests, params, use_tqdm=False)
        except StackError:
            raise
        except Exception as e:  # a rank's forward raised (a capture check in it, or vLLM itself)
            raise StackError(f"a vLLM tensor-parallel rank failed in its forward: {one_line(e)}") from e

    def sample(self, prompts, spec, taps, sink):
        raise StackError(self.declare(ranks=self._ranks()).refused["--mode generate"])

    def info(self) -> StackInfo:
        info = super().info()
        info.settings["model_runner"] = self._described["model_runner"]  # every rank's
        info.settings["tensor_parallel"] = {
            "size": ranks_of(self.settings.engine_kwargs()),
            "column_parallel_taps_gathered": sorted(self._family_and_replicas()[0].column_parallel),
            "cpu_threads_bind": self._binding,  # VLLM_CPU_OMP_THREADS_BIND of the ranks (CPU)
        }
        return info

