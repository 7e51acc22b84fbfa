"""compare --mode generate: diff what RL actually sees.

The inference stack samples responses through its decode path (KV cache, batched requests) and reports the
raw logprob of every sampled token, as RL frameworks record them; the training stack recomputes
teacher-forced logprobs of prompt+response in one forward, as a trainer does. Taps are captured on every
decode step and stitched per sequence, so layer-level diffs cover the response tokens too. Response tokens
give the headline and RL metrics; prompt tokens are reported separately (`prompt_*` columns).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import pandas as pd

from .batch_invariance import measure as measure_batch_invariance
from .capture import TapPairing
from .compare import (CompareOptions, CompareRun, TokenScore, batches, noise_floor_columns, run_manifest,
                      score_prompt)
from .errors import ProbeError
from .prompts import Prompt, default_prompts_path, load_prompts
from .tables import summary_row
from .rl_metrics import bucket_table, sequence_metrics, token_metrics
from .stacks import SamplingSpec
from .taps import expected_taps, parse_tap_selection


@dataclass(frozen=True, kw_only=True)
class GenerateOptions:
    max_new_tokens: int = 64
    samples_per_prompt: int = 1
    temperature: float = 1.0
    """Changes what is sampled; the compared logprobs stay the raw (untempered) ones on both sides."""
    top_p: float = 1.0
    clip_eps: float = 0.2
    """PPO clip band [1-eps, 1+eps] for the clipping and sequence-ratio metrics."""
    tis_cap: float = 2.0
    """Truncated-importance-sampling cap C (and token MIS band [1/C, C])."""

    def __post_init__(self) -> None:
        checks = [
            (self.max_new_tokens >= 1, "--max-new-tokens must be at least 1"),
            (self.samples_per_prompt >= 1, "--samples-per-prompt must be at least 1"),
            (self.temperature >= 0, "--temperature must be >= 0 (0 = greedy)"),
            (0 < self.top_p <= 1, "--top-p must be in (0, 1]"),
            (0 < self.clip_eps < 1, "--clip-eps must be in (0, 1)"),
            (self.tis_cap > 1, "--tis-cap must be > 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ProbeError(message)

    def spec(self, seed: int) -> SamplingSpec:
        return SamplingSpec(max_new_tokens=self.max_new_tokens, samples_per_prompt=self.samples_per_prompt,
                            temperature=self.temperature, top_p=self.top_p, seed=seed)


@dataclass
class RolloutTokenScore(TokenScore):
    sample_id: int = 0
    is_response: bool = False


@dataclass
class RolloutRun(CompareRun):
    generate: GenerateOptions = field(default_factory=GenerateOptions)

    def _split(self):
        return [t for t in self.tokens if t.is_response], [t for t in self.tokens if not t.is_response]

    @property
    def responses_table(self) -> pd.DataFrame:
        df = self.tokens_table
        df = df[df["is_response"]].copy()
        df["response_position"] = df["position"] - df.groupby(["prompt_id", "sample_id"])["position"].transform("min")
        return df

    @property
    def summary(self) -> dict:
        response, prompt = self._split()
        if not response:
            raise ProbeError("no response tokens were sampled (every sample ended at once); raise --max-new-tokens")
        row = summary_row(response, self.tap_stats, self.threshold)
        prompt_row = summary_row(prompt, {}, self.threshold) if prompt else {}
        row["prompt_mean_abs_dlogp"] = prompt_row.get("mean_abs_dlogp", float("nan"))
        row["prompt_mean_kl"] = prompt_row.get("mean_kl", float("nan"))
        g = self.generate
        responses = self.responses_table
        row |= token_metrics(responses["logprob_infer"].to_numpy(), responses["logprob_train"].to_numpy(),
                             g.clip_eps, g.tis_cap)
        row |= sequence_metrics(responses, g.clip_eps)
        return row | noise_floor_columns(self.batch_invariance)

    @property
    def buckets_table(self) -> pd.DataFrame:
        return bucket_table(self.responses_table, self.generate.clip_eps, self.generate.tis_cap)


def run_generate(probe, options: CompareOptions, gen: GenerateOptions) -> RolloutRun:
    prompts_path = Path(options.prompts) if options.prompts is not None else default_prompts_path()
    if gen.max_new_tokens >= probe.settings.max_model_len - 1:
        raise ProbeError(f"--max-new-tokens {gen.max_new_tokens} leaves no room for a prompt in the context of "
                         f"{probe.settings.max_model_len} tokens")
    prompts = load_prompts(prompts_path, probe.tokenizer, num_prompts=options.num_prompts,
                           max_prompt_tokens=options.max_prompt_tokens,
                           max_model_len=probe.settings.max_model_len - gen.max_new_tokens)
    taps = parse_tap_selection(options.taps)
    pairing = TapPairing(expected_taps(taps, probe.source.num_layers, probe.source.has_qk_norm))
    spec = gen.spec(probe.config.seed)
    tokens: list[RolloutTokenScore] = []
    sampled: list[Prompt] = []  # every prompt+response, for the noise floor
    done = 0
    for group in batches(prompts, max(1, probe.settings.batch_tokens // gen.samples_per_prompt)):
        sequences = probe.infer.sample(group, spec, taps, pairing.park)
        for seq in sequences:
            fed = len(seq.token_ids) - 1  # the engine never feeds its last sample back: compare those rows

            def pair(seq_id, key, x, fed=fed):
                pairing.pair(seq_id, key, x[:fed])

            as_prompt = Prompt(seq.seq_id, f"prompt {seq.prompt_id} sample {seq.sample_id}", "", seq.token_ids)
            sampled.append(as_prompt)
            [train] = probe.train.score([as_prompt], taps, pair)
            scored = score_prompt(probe, as_prompt, seq.logits, seq.logprobs, train.logits, train.logprobs)
            pairing.finish_prompt(seq.seq_id)
            tokens += [RolloutTokenScore(**(asdict(t) | {"prompt_id": seq.prompt_id}), sample_id=seq.sample_id,
                                         is_response=t.position >= seq.n_prompt) for t in scored]
        done += len(group)
        if options.progress:
            options.progress(done, len(prompts))
    manifest = run_manifest(probe, "generate", prompts_path, prompts, options, taps)
    manifest["generate"] = asdict(gen) | {"logprobs": "raw (untempered log-softmax of the logits)"}
    floor = measure_batch_invariance(probe, sampled) if options.batch_invariance else None
    return RolloutRun(prompts, tokens, pairing.stats, options.threshold, manifest, floor, generate=gen)
