"""transformers sharded over N processes with its tensor-parallel plan, as the training stack (--train-tp N).

    divergence-probe compare --model M --train-tp 2 --batch-invariance

Megatron-style tensor parallelism, as the Megatron backends of verl, slime and NeMo-RL shard their trainers: the
model's own `base_model_tp_plan` (transformers' Qwen2/Qwen3: q/k/v and gate/up column-parallel, o_proj and down_proj
row-parallel, the embedding split over the vocabulary, the LM head column-parallel with its logits gathered),
applied with transformers' `apply_tensor_parallelism` (DTensor) to the model HFStack loads, in each of N spawned
processes (a script that calls the API needs an `if __name__ == "__main__":` guard). `from_pretrained(tp_plan="auto")`
builds the same layout but needs the accelerate package; loading whole and keeping the rank's slice
(`distribute_tensor(..., src_data_rank=None)`, what the plan's styles call) is the same sharding. Collectives: gloo on
the CPU (the process's cores split between the ranks), NCCL on GPUs (rank r on cuda:first+r, first: --train-device's
index).

Every rank runs every forward (its collectives need all of them) through the very HFStack the unsharded trainer is
(the same numerics state, SDPA kernel, seams, logprobs); rank 0's logits, whole after the LM head's gather, its
logprobs and its taps come back, one sequence per request, so the run loop is unchanged. Taps come back whole, as the
engine side's do at tensor_parallel_size > 1: a column-parallel tap is all-gathered over the ranks in rank order, the
row-parallel outputs are already all-reduced (`_score_gathered`). A row-parallel output is the sum of the ranks'
partial products, each rounded to the dtype first: where the sharded trainer's numerics leave the unsharded one's
(batch_invariance.train_parallel_noise measures it). Regions, --graft/--depth and AMP are refused in one line (spec).
A rank that fails or dies ends the run in one line naming it.
"""

from __future__ import annotations

import io
import os
import socket
from dataclasses import replace
from multiprocessing.connection import Connection, wait
from typing import Sequence

import torch

from ...errors import StackError, one_line
from ...prompts import Prompt
from ...taps import ALL_TAPS
from .policy import HFPolicy, rank_devices
from ..protocol import (CAPTURED, PATCH_NEVER, PATCH_ONCE_LOADED, TRAINER_REGIONS, Capabilities, PromptScores,
                        SamplingSpec, ScoresSink, SequenceScores, StackInfo, StackSettings, TapSink)

START_SECONDS = 600  # most a rank may take to load its shard and answer
STOP_SECONDS = 30


class ShardedHFStack(HFPolicy):
    """The `hf` stack at --train-tp N: N spawned ranks, this process proxies score/score_batched/info to them."""

    def __init__(self) -> None:
        self.settings: StackSettings | None = None
        self._procs: list = []
        self._conns: list[Connection] = []
        self.model = None  # the model lives in the ranks: no region can be patched from here (spec refuses them)

    @classmethod
    def declare(cls, engine: str = "eager", ranks: int = 2) -> Capabilities:
        """Every tap, gathered from the ranks; nothing that runs the trainer's modules in this process."""
        graft = (f"--graft/--depth run the trainer's single ops in this process, but --train-tp {ranks} shards its "
                 "modules over worker processes; drop --graft/--depth or use --train-tp 1")
        regions = (f"regions are patched into the trainer's modules, which live in --train-tp {ranks}'s worker "
                   "processes; use --side infer (the engine alone) or --train-tp 1")
        generate = (f"--mode generate samples with transformers' generate in this process, but --train-tp {ranks} "
                    "shards the model over worker processes; use --mode prefill or --train-tp 1")
        return Capabilities(taps={name: CAPTURED for name in ALL_TAPS}, patch=PATCH_NEVER,
                            refused={"--graft": graft, "--depth": graft, TRAINER_REGIONS: regions,
                                     PATCH_ONCE_LOADED: regions, "--mode generate": generate})

    def capabilities(self) -> Capabilities:
        return self.declare(ranks=self.settings.train_tp)

    def begin_run(self) -> None:
        """Nothing of a run is kept between runs."""

    def load(self, settings: StackSettings) -> None:
        import multiprocessing as mp

        ranks = settings.train_tp
        devices = rank_devices(settings.device, ranks)  # checked before anything loaded (check_shardable)
        cores = sorted(os.sched_getaffinity(0))
        threads = max(1, len(cores) // ranks)
        self.settings = settings
        ctx = mp.get_context("spawn")
        port = _free_port()
        try:
            for rank in range(ranks):
                mine, theirs = ctx.Pipe()
                proc = ctx.Process(target=_rank_main, args=(rank, ranks, port, settings, devices[rank], threads,
                                                            theirs), daemon=True, name=f"divergence-probe-train-tp{rank}")
                proc.start()
                theirs.close()
                self._procs.append(proc)
                self._conns.append(mine)
            self._answers("start", START_SECONDS)
        except BaseException:
            self.close()
            raise

    def _ask(self, request: tuple) -> list:
        """Send one request to every rank; every rank's answer (rank 0's carries the results)."""
        payload = _dumps(request)
        for conn in self._conns:
            try:
                conn.send_bytes(payload)
            except OSError:  # a rank that died: _answers reads its end and names it
                pass
        return self._answers(request[0], None)

    def _answers(self, what: str, timeout: float | None) -> list:
        """Every rank's answer to `what`; the first rank that fails or dies is one StackError (the others are
        stopped: they would wait in a collective for it forever). A rank that died is named before one that failed
        in a collective with it: the dead one is the cause."""
        answers: dict[int, object] = {}
        pending = dict(enumerate(self._conns))
        ranks = len(self._conns)
        while pending:
            ready = wait(list(pending.values()), timeout)
            if not ready:
                self._stop(force=True)
                raise StackError(f"the sharded trainer's ranks did not answer {what} within {timeout:.0f} s; "
                                 "lower --train-tp or check the machine's load")
            for conn in ready:
                rank = next(r for r, c in pending.items() if c is conn)
                try:
                    status, value = _loads(conn.recv_bytes())
                except (EOFError, OSError):
                    status, value = "died", None
                if status != "ok":
                    message = self._failure(rank, ranks, what, value)
                    self._stop(force=True)
                    raise StackError(message)
                answers[rank] = value
                del pending[rank]
        return [answers[r] for r in range(ranks)]

    def _failure(self, rank: int, ranks: int, what: str, error: str | None) -> str:
        """The one line for a failed request: the rank that died, if one did (`error` None: `rank` closed its pipe;
        else another rank, whose death `rank`'s collective reports as its error), else `rank`'s own error."""
        if error is None:
            self._procs[rank].join(STOP_SECONDS)  # a closed pipe: its process is ending
        for r, proc in enumerate(self._procs):
            dead = proc.exitcode is not None and (r == rank if error is None else r != rank and proc.exitcode != 0)
            if dead:
                return (f"trainer rank {r} of {ranks} exited (code {proc.exitcode}) during {what}; rerun with -v for "
                        "its output, or lower --train-tp")
        return f"trainer rank {rank} of {ranks} failed during {what}: {error or 'it closed its pipe without answering'}"

    def score(self, prompts: Sequence[Prompt], taps: frozenset[str], sink: TapSink,
              on_scored: ScoresSink | None = None) -> list[PromptScores]:
        """One request per sequence: rank 0's scores and gathered taps of one sequence cross at a time, and its taps
        go to `sink` before its scores are delivered, as HFStack hands them over."""
        results: list[PromptScores] = []
        deliver = on_scored or results.append
        for prompt in prompts:
            scores, kept = self._ask(("score", ([prompt], frozenset(taps))))[0]
            for key, x in kept:
                sink(prompt.prompt_id, key, x)
            deliver(scores)
        return results

    def score_batched(self, prompts: Sequence[Prompt], taps: frozenset[str] = frozenset(),
                      sink: TapSink | None = None) -> list[PromptScores]:
        if taps:
            raise StackError(f"a sharded trainer captures no taps in a batched forward (asked: {', '.join(sorted(taps))})")
        return self._ask(("score_batched", list(prompts)))[0]

    def sample(self, prompts: Sequence[Prompt], spec: SamplingSpec, taps: frozenset[str],
               sink: TapSink) -> list[SequenceScores]:
        """Refused as declared: the ranks serve scoring only."""
        raise StackError(self.capabilities().refused["--mode generate"])

    def batch_groups(self, prompts: Sequence[Prompt]) -> list[list[Prompt]]:
        from ...prompts import padded_batches

        return list(padded_batches(prompts, self.settings.batch_tokens))

    def info(self) -> StackInfo:
        info = self._ask(("info", None))[0]
        info.settings["tensor_parallel"] = {
            "size": self.settings.train_tp, "devices": rank_devices(self.settings.device, self.settings.train_tp),
            "backend": "gloo" if self.settings.device == "cpu" else "nccl",
            "plan": "the model's base_model_tp_plan (transformers' apply_tensor_parallelism, DTensor)",
            "logits": "rank 0's, gathered over the vocabulary by the LM head's colwise_gather_output"}
        return info

    def close(self) -> None:
        self._stop(force=False)

    def _stop(self, force: bool) -> None:
        """Stop the ranks: asked to, or at once (`force`: after a rank failed, the others may wait in a collective
        for it and would never read the request)."""
        conns, procs, self._conns, self._procs = self._conns, self._procs, [], []
        for conn in conns if not force else []:
            try:
                conn.send_bytes(_dumps(("close", None)))
            except (OSError, ValueError):
                pass
        for proc in procs:
            proc.join(0 if force else STOP_SECONDS)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in conns:
            conn.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dumps(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _loads(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)


def _rank_main(rank: int, ranks: int, port: int, settings: StackSettings, device: str, threads: int,
               conn: Connection) -> None:
    """One rank: join the process group, load the model whole as HFStack does, keep this rank's shards, then serve
    requests until "close"."""
    import torch.distributed as dist

    stack = None
    try:
        torch.set_num_threads(threads)
        if device != "cpu":
            torch.cuda.set_device(device)
        dist.init_process_group("gloo" if device == "cpu" else "nccl", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=ranks)
        from torch.distributed.device_mesh import init_device_mesh
        from transformers.distributed.tensor_parallel import apply_tensor_parallelism

        from .trainer import HFStack

        stack = HFStack()
        stack.load(replace(settings, device=device, train_tp=1))
        apply_tensor_parallelism(stack.model, init_device_mesh(torch.device(device).type, (ranks,)),
                                 stack.model.tp_plan)
        conn.send_bytes(_dumps(("ok", None)))
        while True:
            what, arg = _loads(conn.recv_bytes())
            if what == "close":
                break
            try:
                if what == "score":
                    value = _score_gathered(stack, *arg, rank, ranks)
                elif what == "score_batched":
                    value = [_on_host(s) for s in stack.score_batched(arg)]
                else:
                    value = stack.info()
            except Exception as e:  # noqa: BLE001 - any rank's failure is the run's one line
                conn.send_bytes(_dumps(("error", one_line(f"{type(e).__name__}: {e}", 300))))
                return
            conn.send_bytes(_dumps(("ok", value if rank == 0 else None)))
    except Exception as e:  # noqa: BLE001
        try:
            conn.send_bytes(_dumps(("error", one_line(f"{type(e).__name__}: {e}", 300))))
        except OSError:
            pass
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _score_gathered(stack, prompts: list[Prompt], taps: frozenset[str], rank: int, ranks: int):
    """One sequence on this rank's shard, its taps made whole: a column-parallel tap (the family's `column_parallel`:
    a column GEMM's output and what stays per head or per feature after it) is this rank's slice of the features, so
    the ranks' slices are all-gathered and joined in rank order (every rank emits the same taps in the same order, so
    the collectives pair up); every other tap (the row-parallel outputs after their all-reduce, the residual stream,
    the norms, the gathered logits) is whole in every rank. Rank 0 keeps host copies: (scores, [(key, tap)])."""
    import torch.distributed as dist

    from ...models import family_of

    column = family_of(stack.model).column_parallel
    kept = []

    def sink(_prompt_id, key, x) -> None:
        if key.name in column:
            x = x.contiguous()
            parts = [torch.empty_like(x) for _ in range(ranks)]
            dist.all_gather(parts, x)
            x = torch.cat(parts, dim=-1)
        if rank == 0:
            kept.append((key, x.detach().cpu().clone()))  # a compact copy: a view would pickle its whole storage

    [scores] = stack.score(prompts, taps, sink)
    return _on_host(scores), kept


def _on_host(scores: PromptScores) -> PromptScores:
    return PromptScores(scores.prompt_id, scores.logits.cpu(), scores.logprobs.cpu())
