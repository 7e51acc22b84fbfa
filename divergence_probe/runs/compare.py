"""compare: the one run loop. Feed both stacks the same token sequences and diff every tap and token logprob.

Prefill and generate mode differ only in where the sequences come from (`SequenceSource`): the prompts
themselves, scored by the inference stack's prefill, or prompt+response sequences the inference stack sampled
through its decode path. Either way an inference batch runs first and parks its taps; then the training stack
runs the batch's sequences, and as each is done its taps are paired and reduced (runs/capture.py) and its logits
scored against the inference logits at every position. Nothing per-layer outlives its sequence. In generate mode the
engine then scores every sampled sequence once more in one prefill (`engine_prefill`), which splits the RL ratio into
trainer/prefill × prefill/decode × decode/recorded (rl_metrics.ratio_split).
"""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import pandas as pd

from .batch_invariance import TAP_POINTS_CHANGE, TENSOR_PARALLEL_CHANGE, TRAIN_TENSOR_PARALLEL_CHANGE, KernelFloor, \
    engine_noise, routing_noise, train_parallel_noise, concat_floors, sequence_sums
from .batch_invariance import measure as measure_batch_invariance
from .. import timings
from .capture import TapPairing
from .loop import PendingScores, ScoredSequence, SequenceSource, score_both
from ..errors import ProbeError, StackError
from ..numerics.fused import backend as fused_backend
from .measured import Peaks, engine_report
from ..numerics.metrics import DiffStats
from ..numerics import reference as reference_columns
from ..prompts import Prompt
from ..regions import from_engine
from .manifest import build_manifest
from .progress import Progress, phase
from .reference import ReferenceCapture, ReferenceResult, reference_arm
from .route_capture import RouteCapture, RunRouting
from .scored import TokenScore
from ..numerics.rl_metrics import bucket_table, ratio_split, sequence_metrics, token_metrics
from ..rundir import ROLLOUTS
from ..spec.run import RunSpec
from ..numerics.noise_verdict import FLOOR_PROMPT_COLUMNS, floor_columns, manifest_record
from ..numerics.tables import (FLOOR_KINDS, ROUTING_NOISE_FLOORS, largest_noise_floor, layers_frame, summary_row,
                               tokens_frame)
from ..taps import ROUTE_RECORDS, TapKey, expected_taps

class SampledSource(SequenceSource):
    """generate mode: the inference stack samples responses (decode path, KV cache) and reports raw logprobs."""

    mode = "generate"

    def __init__(self, sampling) -> None:
        self.sampling = sampling

    def batch_tokens(self, probe) -> int:
        return max(1, probe.settings.batch_tokens // self.sampling.samples_per_prompt)

    def batch_count(self, probe) -> int | None:
        most = super().batch_count(probe)
        return None if most is None else max(1, most // self.sampling.samples_per_prompt)

    def run(self, probe, group, taps, park, first_key):
        def park_keyed(seq_id, key, x):  # the stack numbers a call's sequences from 0; a run numbers them once
            park(first_key + seq_id, key, x)

        sequences = probe.infer.sample(group, self.sampling, taps, park_keyed)
        return [ScoredSequence(first_key + s.seq_id,
                          Prompt(first_key + s.seq_id, f"prompt {s.prompt_id} sample {s.sample_id}", "", s.token_ids),
                          s.logits, s.logprobs, s.prompt_id, len(s.token_ids) - 1, s.sample_id, s.n_prompt)
                for s in sequences]


def engine_prefill(stack, sequences: Sequence[Prompt]) -> list[list[float]]:
    """generate mode's `logprob_prefill`: the inference stack scores every sampled sequence, prompt and response, in
    one prefill (no taps, its steps as the noise floor batches them), after the run loop, so that no tap still parked
    lives in a buffer this pass writes. It must not be served from the decode's cached KV, which would make the
    prefill/decode factor 1 by construction: vLLM computes every prompt token of such a request (`score` asks for prompt
    logprobs and sets skip_reading_prefix_cache, prefix caching on or off), and `score` refuses a step whose rows are
    not whole sequences."""
    prefill: list[list[float]] = []
    for group in stack.batch_groups(sequences):
        scores = stack.score(group, frozenset(), lambda *_: None)
        if [s.prompt_id for s in scores] != [seq.prompt_id for seq in group]:
            raise StackError("the inference stack returned its prefill scores out of order")
        prefill += [s.logprobs.double().cpu().tolist() for s in scores]  # float32 values, exact in float64
    return prefill


def with_prefill(tokens: list[TokenScore], sequences: Sequence[Prompt], prefill: list[list[float]]) -> None:
    """File each sequence's prefill logprobs on its tokens (the run loop collects tokens sequence by sequence, each
    sequence's positions 1..L-1 in order)."""
    if len(prefill) != len(sequences):
        raise StackError(f"the inference stack's prefill scored {len(prefill)} of {len(sequences)} sampled sequences")
    at = 0
    for seq, logprobs in zip(sequences, prefill):
        if len(logprobs) != len(seq.token_ids) - 1:
            raise StackError(f"the inference stack's prefill of sequence {seq.prompt_id} scored {len(logprobs)} of "
                             f"its {len(seq.token_ids) - 1} positions")
        for token, lp in zip(tokens[at : at + len(logprobs)], logprobs):
            token.logprob_prefill = lp
        at += len(logprobs)
    if at != len(tokens):
        raise StackError(f"{len(tokens)} tokens were scored but the sampled sequences hold {at}")


@dataclass
class CompareRun:
    """The result of one comparison (prefill or generate mode); `write` puts it on disk as CSVs and a manifest."""

    spec: RunSpec
    prompts: list[Prompt]
    tokens: list[TokenScore]
    tap_stats: dict[TapKey, DiffStats]
    manifest: dict = field(default_factory=dict)
    batch_invariance: pd.DataFrame | None = None
    kernel_noise: pd.DataFrame | None = None
    graft_tables: dict[str, pd.DataFrame] = field(default_factory=dict)  # local.csv, ... (--graft, --depth)
    engine_noise: pd.DataFrame | None = None
    routing: RunRouting | None = None  # a mixture-of-experts model's routing comparison (runs/route_capture.py)
    routing_noise: pd.DataFrame | None = None  # each stack's own routing under a batch change (--batch-invariance)
    floor_prompts: pd.DataFrame | None = None  # each floor's per-prompt |Δlogp| sums (floor_prompt_table), not written
    reference: ReferenceResult | None = None  # --reference: each stack against the reference (runs/reference.py)

    @property
    def mode(self) -> str:
        return self.spec.generate.mode

    @property
    def threshold(self) -> float:
        return self.spec.capture.threshold

    @property
    def tokens_table(self) -> pd.DataFrame:
        df = tokens_frame(self.tokens, sampled=self.mode == "generate")
        df = self.routing.token_columns(df) if self.routing is not None else df
        return df if self.reference is None else \
            reference_columns.token_columns(df, self.reference.logprob_ref, self.reference.floor)

    @property
    def layers_table(self) -> pd.DataFrame:
        df = layers_frame(self.tap_stats)
        return df if self.reference is None else reference_columns.layer_columns(df, self.reference.sums)

    @property
    def reference_local_table(self) -> pd.DataFrame:
        """reference_local.csv (--reference, a stack that replays its ops): the local reading."""
        return reference_columns.local_frame(self.reference.local)

    @property
    def routing_table(self) -> pd.DataFrame | None:
        """routing.csv (a mixture-of-experts model with router_logits among the taps), else None."""
        return self.routing.table() if self.routing is not None else None

    @property
    def responses_table(self) -> pd.DataFrame:
        """generate mode: the response tokens, with their position in the response."""
        df = self.tokens_table
        df = df[df["is_response"]].copy()
        df["response_position"] = df["position"] - df.groupby(["prompt_id", "sample_id"])["position"].transform("min")
        return df

    @property
    def rollouts_table(self) -> pd.DataFrame:
        """generate mode: one row per sample in the rollout layout of --rollouts-format (rollouts/adapters.py): the
        prompt's ids, the sampled ids and the engine's decode logprob of each (this run's recording), the prompt id as
        the group. `score` on it scores the same tokens against the same recording."""
        from ..rollouts.adapters import export_row

        prompts = {p.prompt_id: p for p in self.prompts}
        records = []
        for (prompt_id, _), part in self.responses_table.groupby(["prompt_id", "sample_id"], sort=True):
            part = part.sort_values("position")
            records.append(export_row(self.spec.generate.rollouts_format, list(prompts[prompt_id].token_ids),
                                      part.token_id.tolist(), part.logprob_infer.tolist(), int(prompt_id)))
        return pd.DataFrame.from_records(records)

    @property
    def summary(self) -> dict:
        row = self._summary()
        floors = self.floor_prompts if self.floor_prompts is not None else pd.DataFrame(columns=FLOOR_PROMPT_COLUMNS)
        return (row | floor_columns(self.tokens_table, row, self.spec.load.seed, floors) | self._routing_summary()
                | self._reference_summary(row))

    def _reference_summary(self, row: dict) -> dict:
        """--reference: which side is further from exact where the mismatch starts (numerics/reference.py)."""
        if self.reference is None:
            return {}
        tokens = self.tokens_table
        if self.mode == "generate":
            tokens = tokens[tokens["is_response"]]
        return reference_columns.summary_columns(self.reference.precision, self.reference.sums, tokens,
                                                 reference_columns.start_of(row), self.spec.load.seed)

    def _routing_summary(self) -> dict:
        if self.routing is None:
            return {}
        tokens = self.tokens_table
        if self.mode == "generate":
            tokens = tokens[tokens["is_response"]]
        columns = self.routing.summary(tokens) | routing_noise_columns(self.routing_noise)
        return columns | routing_verdict_columns(columns)

    def _summary(self) -> dict:
        if self.mode != "generate":
            return (summary_row(self.tokens, self.tap_stats, self.threshold)
                    | noise_floor_columns(self.batch_invariance, self.kernel_noise, self.engine_noise))
        response = [t for t in self.tokens if t.is_response]
        prompt = [t for t in self.tokens if not t.is_response]
        if not response:
            raise ProbeError("no response tokens were sampled (every sample ended at once); raise --max-new-tokens")
        row = summary_row(response, self.tap_stats, self.threshold)
        prompt_row = summary_row(prompt, {}, self.threshold) if prompt else {}
        row["prompt_mean_abs_dlogp"] = prompt_row.get("mean_abs_dlogp", float("nan"))
        row["prompt_mean_kl"] = prompt_row.get("mean_kl", float("nan"))
        g = self.spec.generate
        responses = self.responses_table
        row |= token_metrics(responses["logprob_infer"].to_numpy(), responses["logprob_train"].to_numpy(),
                             g.clip_eps, g.tis_cap)
        row |= sequence_metrics(responses, g.clip_eps)
        # the decode logprobs are this run's recording: the third factor, decode/recorded, is 1 by construction
        row |= ratio_split({"train": responses["logprob_train"].to_numpy(),
                            "prefill": responses["logprob_prefill"].to_numpy(),
                            "decode": responses["logprob_infer"].to_numpy()})
        return row | noise_floor_columns(self.batch_invariance, self.kernel_noise, self.engine_noise)

    @property
    def buckets_table(self) -> pd.DataFrame | None:
        """generate mode: the token metrics per bucket of inference-side probability and of response position."""
        if self.mode != "generate":
            return None
        g = self.spec.generate
        return bucket_table(self.responses_table, g.clip_eps, g.tis_cap)

    def files(self) -> dict[str, pd.DataFrame]:
        """The run folder's tables, by file name, in the order they are written."""
        tables = {"tokens.csv": self.tokens_table, "layers.csv": self.layers_table,
                  "summary.csv": pd.DataFrame([self.summary])}
        if self.mode == "generate":
            tables["buckets.csv"] = self.buckets_table
            tables[ROLLOUTS] = self.rollouts_table
        if self.batch_invariance is not None:
            tables["batch_invariance.csv"] = self.batch_invariance
        if self.kernel_noise is not None:
            tables["kernel_noise.csv"] = self.kernel_noise
        tables |= self.graft_tables
        if self.engine_noise is not None:
            tables["engine_noise.csv"] = self.engine_noise
        if self.routing is not None:
            tables["routing.csv"] = self.routing_table
        if self.routing_noise is not None:
            tables["routing_noise.csv"] = self.routing_noise
        if self.reference is not None and self.reference.local is not None:
            tables["reference_local.csv"] = self.reference_local_table
        return tables

    def write(self, out_dir: str | Path) -> Path:
        from ..rundir import write_run

        return write_run(Path(out_dir), self.manifest | manifest_record(self.summary), self.prompts, self.files())


def _floor_rows(floor, kernel=None, engine=None) -> dict[str, tuple[pd.DataFrame, int]]:
    """Each floor summary column measured -> (its table, its row there): each stack's batch-1-vs-batched row, the
    training stack's under another attention kernel and unsharded (at --train-tp > 1), and the engine's in its
    other mode (eager vs compiled) or at tensor_parallel_size 1, and the engine's with vs without tap points."""
    rows = {} if floor is None else {f"noise_{r.side}_mean_abs_dlogp": (floor, i)
                                     for i, r in enumerate(floor.itertuples())}

    def first(table, name: str, where) -> None:
        at = [i for i, change in enumerate(table.change) if where(change)]
        if at:
            rows[name] = (table, at[0])

    if kernel is not None:
        first(kernel, "noise_train_kernel_mean_abs_dlogp", lambda c: not c.startswith(TRAIN_TENSOR_PARALLEL_CHANGE))
        first(kernel, "noise_train_tensor_parallel_mean_abs_dlogp", lambda c: c.startswith(TRAIN_TENSOR_PARALLEL_CHANGE))
    if engine is not None:
        first(engine, "noise_infer_engine_mode_mean_abs_dlogp", lambda c: c.startswith("engine "))
        first(engine, "noise_infer_tensor_parallel_mean_abs_dlogp", lambda c: c.startswith(TENSOR_PARALLEL_CHANGE))
        # 0 when the tap points left the compiled graph's numerics alone, as they should
        first(engine, "tap_points_mean_abs_dlogp", lambda c: c.startswith(TAP_POINTS_CHANGE))
    return rows


def noise_floor_columns(floor, kernel=None, engine=None) -> dict:
    """Each floor's mean |Δlogp| (_floor_rows), for the summary beside the mismatch (if measured)."""
    return {name: float(table.mean_abs_dlogp.iloc[i]) for name, (table, i) in _floor_rows(floor, kernel, engine).items()}


def floor_prompt_table(prompt_of: dict[int, int], floor, kernel=None, engine=None) -> pd.DataFrame:
    """Each floor's |Δlogp| summed per prompt (noise_verdict.FLOOR_PROMPT_COLUMNS), from the per-sequence sums the
    floor tables carry; `prompt_of`: each scored sequence's key -> its prompt (sequence_prompts)."""
    parts = []
    for name, (table, i) in _floor_rows(floor, kernel, engine).items():
        sums = sequence_sums(table, i)
        by_prompt = sums.assign(prompt_id=sums["sequence"].map(prompt_of)).groupby("prompt_id", sort=True)
        parts.append(by_prompt[["n", "sum_abs_dlogp"]].sum().reset_index().assign(floor=name))
    return pd.concat(parts, ignore_index=True)[FLOOR_PROMPT_COLUMNS] if parts else \
        pd.DataFrame(columns=FLOOR_PROMPT_COLUMNS)


def sequence_prompts(tokens: Sequence[TokenScore], sequences: Sequence[Prompt], generate: bool) -> dict[int, int]:
    """Each scored sequence's key -> the prompt it was sampled from. In prefill mode a sequence is its prompt; in
    generate mode the run loop collects tokens sequence by sequence in the order of `sequences` (with_prefill relies
    on the same), so the i-th run of one (prompt, sample) among the tokens is the i-th sequence."""
    if not generate:
        return {seq.prompt_id: seq.prompt_id for seq in sequences}
    blocks, last = [], None
    for t in tokens:
        if (t.prompt_id, t.sample_id) != last:
            blocks.append(t.prompt_id)
            last = (t.prompt_id, t.sample_id)
    if len(blocks) != len(sequences):
        raise StackError(f"{len(blocks)} sampled sequences were scored, but the run holds {len(sequences)}")
    return {seq.prompt_id: prompt for seq, prompt in zip(sequences, blocks)}


def routing_noise_columns(floor: pd.DataFrame | None) -> dict:
    """Each stack's own routing flips under a batch change, and the trainer's under a kernel change, beside the
    cross-stack flip rate: the mean over layers of frac_experts_differ and of frac_topk_set_differs, and
    frac_tokens_any_flip (if measured)."""
    if floor is None:
        return {}
    columns = {}
    for (side, change), rows in floor.groupby(["side", "change"], sort=False):
        prefix = f"noise_{side}_" if change == "batched vs alone" else f"noise_{side}_kernel_"
        columns[f"{prefix}frac_experts_differ"] = float(rows["frac_experts_differ"].mean())
        columns[f"{prefix}frac_topk_set_differs"] = float(rows["frac_topk_set_differs"].mean())
        columns[f"{prefix}frac_tokens_any_flip"] = float(rows["frac_tokens_any_flip"].iloc[0])
    return columns


def routing_verdict_columns(summary: dict) -> dict:
    """The cross-stack frac_tokens_any_flip against the largest routing noise floor measured, whichever change made
    it (tables.ROUTING_NOISE_FLOORS: each stack's batch change, the trainer's kernel change): the floor's summary
    column, its kind (tables.FLOOR_KINDS: a ratio over a kernel swap's flips is not one over noise) and the ratio.
    Empty when no floor was measured."""
    largest = largest_noise_floor(summary, ROUTING_NOISE_FLOORS)
    if largest is None:
        return {}
    flips = summary.get("frac_tokens_any_flip", math.nan)
    ratio = flips / largest[1] if largest[1] > 0 else (math.inf if flips > 0 else math.nan)
    return {"routing_largest_noise_floor": largest[0], "routing_noise_floor_kind": FLOOR_KINDS[largest[0]],
            "frac_tokens_any_flip_over_largest_floor": ratio}


def source_for(spec: RunSpec) -> SequenceSource:
    return SampledSource(spec.generate) if spec.generate.generates else SequenceSource()


def run_manifest(probe, spec: RunSpec, prompts_path: Path, prompts, taps) -> dict:
    """The probe's manifest plus what this run scored and captured, and the spec that re-makes it."""
    sections = {}
    sections["compare"] = {
        "mode": spec.generate.mode,
        "prompts": str(prompts_path),
        "prompt_files_sha256": prompts.file_sha256,  # of the bytes these prompts were read from
        "num_prompts": len(prompts),
        "max_prompt_tokens": spec.prompts.max_prompt_tokens,
        "taps": sorted(taps),
        "threshold": spec.capture.threshold,
        "batch_invariance": spec.capture.batch_invariance,
        "engine_noise": spec.capture.engine_noise,
        "tap_reduction": fused_backend() if taps else None,
    }
    if spec.generate.generates:
        g = spec.generate
        sections["generate"] = {"max_new_tokens": g.max_new_tokens, "samples_per_prompt": g.samples_per_prompt,
                                "temperature": g.temperature, "top_p": g.top_p, "clip_eps": g.clip_eps,
                                "tis_cap": g.tis_cap, "logprobs": "raw (untempered log-softmax of the logits)",
                                "logprob_prefill": "the engine's prefill of every sampled sequence after the run loop, "
                                                   "no taps, prefix cache not read"}
    if spec.align.regions:
        sections["align"] = {"regions": list(spec.align.regions), "side": spec.align.side}
    meanings = probe.infer.capabilities().tap_meanings
    if meanings:  # a quantized engine: what its taps are, beside the trainer's tensors of the same names
        sections["compare"]["tap_meanings"] = {tap: meanings[tap] for tap in sorted(meanings) if tap in taps}
    return build_manifest(spec.kind, probe.manifest(), sections, spec=spec.to_dict())


def capturable_taps(probe, spec: RunSpec) -> tuple[frozenset[str], dict[str, str]]:
    """The taps this run captures, and why the others of `--taps all` are not (e.g. inside a compiled graph): `all`
    means every tap both stacks can capture; a list that names one a stack cannot capture is that stack's error."""
    taps = spec.capture.tap_names
    if spec.capture.taps.strip() != "all":
        return taps, {}
    status = {}
    for stack in (probe.infer, probe.train):
        status |= stack.capabilities().not_captured()
    return frozenset(taps - set(status)), dict(sorted(status.items()))


def run_compare(probe, spec: RunSpec, progress: Progress | None = None, *, done_before: int = 0,
                total_scale: int = 1, noise_engines=None, reference=None) -> CompareRun:
    """One compare: the regions of `spec.align` are aligned by the caller (probe.run / ablate). `noise_engines`: the
    other-mode engines of --engine-noise, when the caller shares them between runs (batch_invariance.NoiseEngines);
    `reference`: --reference's arm, when the caller shares it (runs/reference.py)."""
    with reference_arm(probe, spec.capture.reference, reference) as arm:
        return _run_compare(probe, spec, progress, done_before, total_scale, noise_engines, arm)


def _run_compare(probe, spec: RunSpec, progress: Progress | None, done_before: int, total_scale: int, noise_engines,
                 arm) -> CompareRun:
    prompts_path, prompts = probe.run_prompts(spec)
    taps, not_captured = capturable_taps(probe, spec)
    user_taps = taps
    pairing = TapPairing(expected_taps(taps, probe.source.num_layers, probe.source.family.layer_taps))
    capture = graft = pairing
    plan = probe.memory_plan
    if spec.capture.graft or spec.capture.depth:
        from .graft import GraftCapture, check_graftable
        from ..numerics.graft_reading import GRAFT_TAPS

        check_graftable(probe.train)
        taps = taps | GRAFT_TAPS
        pairing = TapPairing(expected_taps(taps, probe.source.num_layers, probe.source.family.layer_taps))
        capture = graft = GraftCapture(pairing, probe.train, probe.source.num_layers,
                                       probe.source.family.layer_taps, spec.capture.depth, _top_k(probe))
    routes, infer_taps, train_taps = _route_capture(probe, spec, capture, taps)
    capture = routes or capture
    if arm is not None:
        capture = ReferenceCapture(capture, arm, probe, user_taps)
    source = source_for(spec)
    tokens: list[TokenScore] = []
    per_prompt = spec.generate.samples_per_prompt if source.mode == "generate" else 1
    done = 0

    def collect(scores: PendingScores) -> None:
        nonlocal done
        tokens.extend(scores.read())
        done += 1
        if progress and done % per_prompt == 0:
            progress(done_before + done // per_prompt, len(prompts) * total_scale)

    pairing.chunk_elements = plan.reduction_chunk_elements if plan is not None else None
    peaks = Peaks(probe.settings.device, plan.inputs.train_device if plan is not None else None)
    if total_scale == 1:  # an ablation names each combination's phase itself
        phase(progress, "scoring prompts, reducing taps")
    with _routes_replayed(probe, spec, routes), timings.timed("run.score"):
        ran = score_both(probe, prompts, source, infer_taps, train_taps, capture, collect, peaks)
    if source.mode == "generate":
        if total_scale == 1:
            phase(progress, "the engine's prefill of every sampled sequence")
        with_prefill(tokens, ran, engine_prefill(probe.infer, ran))
    manifest = run_manifest(probe, spec, prompts_path, prompts, taps)
    reference = capture.result() if arm is not None else None
    if reference is not None:
        manifest["reference"] = reference.manifest
    if "memory_plan" in manifest:
        manifest["memory_plan"]["measured"] = peaks.record() | {"engine": engine_report(probe.infer)}
    run_routing = routes.result() if routes is not None else None
    if routes is not None:
        manifest["compare"]["routing"] = _routing_manifest(probe, spec, routes, run_routing)
    graft_tables = graft.tables(spec.align.regions if spec.align.side != "infer" else ()) \
        if graft is not pairing else {}
    if graft_tables:
        manifest["compare"]["graft"] = {"local": "the training stack's op on the inference stack's input of each seam",
                                        "depth": spec.capture.depth}
    if not_captured:
        manifest["compare"]["taps_not_captured"] = not_captured
    if spec.capture.batch_invariance:
        phase(progress, "noise floor: each stack alone vs batched, another SDPA kernel")
    top_k = routes.top_k if run_routing is not None else None
    floor, kernel, kernel_routes, parallel = None, None, None, None
    if spec.capture.batch_invariance:
        with timings.timed("run.noise_floor.batch"), \
                (KernelFloor(probe, top_k) if KernelFloor.applies(probe) else nullcontext()) as kernel_floor:
            floor = measure_batch_invariance(probe, ran, kernel_floor)
            if kernel_floor is not None:
                kernel, kernel_routes = kernel_floor.result(ran)
        if probe.config.train_tp > 1:
            with timings.timed("run.noise_floor.train_tp"):
                parallel = train_parallel_noise(probe, ran)
    if parallel is not None:  # the trainer's parallelism floor beside its kernel floor
        kernel = parallel if kernel is None else concat_floors([kernel, parallel])
    engine_regions = spec.align.regions if spec.align.side != "train" else ()
    if spec.capture.engine_noise:
        phase(progress, "noise floor: the engine in its other mode")
    engine = None
    if spec.capture.engine_noise:
        with timings.timed("run.noise_floor.engine"):
            engine = engine_noise(probe, ran, engine_regions, noise_engines)
    route_floor = pd.concat([routing_noise(probe, ran, top_k), kernel_routes], ignore_index=True) \
        if spec.capture.batch_invariance and run_routing is not None else None
    floor_prompts = floor_prompt_table(sequence_prompts(tokens, ran, source.mode == "generate"), floor, kernel, engine)
    return CompareRun(spec, prompts, tokens, pairing.stats, manifest, floor, kernel, graft_tables=graft_tables,
                      engine_noise=engine, routing=run_routing, routing_noise=route_floor, floor_prompts=floor_prompts,
                      reference=reference)


def _route_capture(probe, spec: RunSpec, capture, taps: frozenset[str]
                   ) -> tuple[RouteCapture | None, frozenset[str], frozenset[str]]:
    """For a mixture-of-experts model: the routing capture around the run's tap capture, the inference side's taps
    with the engine's route records added (checked against its router logits; replayed under the routing region),
    and the training side's with its router's expert ids added where routing is compared (the experts it ran, which
    the flip counts compare with the engine's). Routing is compared wherever router_logits is among the taps."""
    family = probe.source.family
    replay = "routing" in from_engine(spec.align.regions)
    if family.top_k_field is None:
        return None, taps, taps
    metrics = "router_logits" in taps
    if not (metrics or replay):
        return None, taps, taps
    routes = RouteCapture(capture, num_layers=probe.source.num_layers, top_k=_top_k(probe), metrics=metrics,
                          records=True)
    return routes, taps | frozenset(ROUTE_RECORDS), taps | frozenset({"expert_ids"} if metrics else ())


def _top_k(probe) -> int | None:
    """A mixture-of-experts model's router top-k (None: a dense model)."""
    field_name = probe.source.family.top_k_field
    return None if field_name is None else int(probe.source.config[field_name])


@contextmanager
def _routes_replayed(probe, spec: RunSpec, routes: RouteCapture | None) -> Iterator[None]:
    """The routing region: the trainer runs every sequence with the engine's experts (and with --routing-replay
    ids+weights, the engine's gate weights) for it."""
    if routes is None or "routing" not in spec.align.regions:
        yield
        return
    with_weights = spec.align.routing_replay == "ids+weights"

    def engine_routes(key: int, layer: int):
        ids, weights = routes.routes(key, layer)
        return ids, weights if with_weights else None

    with probe.train.routes_replayed(engine_routes):
        yield


def _routing_manifest(probe, spec: RunSpec, routes: RouteCapture, run_routing: RunRouting | None) -> dict:
    record = {"top_k": routes.top_k, "compared": run_routing is not None,
              "engine_routes": f"{probe.infer.name}: the ids and weights its router returned (vLLM: "
                               "router.select_experts, whose ids are what enable_return_routed_experts records)",
              "replay": spec.align.routing_replay if "routing" in spec.align.regions else None}
    return record | (run_routing.manifest() if run_routing is not None else {})
