"""A run folder as the report sees it (RunData, filled by load.py's load_run) and selections prose and figures share.
Apart from the reading and its checks, so the sections that only read a RunData stay below the run specs."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from ..numerics.shapley import SHIPPED


@dataclass
class RunData:
    """Everything a report reads from one run folder."""

    path: Path
    manifest: dict
    summary: pd.DataFrame
    layers: pd.DataFrame
    clip_eps: float  # the importance-ratio clip the run recorded, checked as its flag is (load_run)
    ci_level: str  # the bootstrap interval's level as the captions say it, e.g. "95%" (load_run)
    tokens: pd.DataFrame | None = None
    tokens_file: str | None = None
    ablation: pd.DataFrame | None = None
    attribution: pd.DataFrame | None = None
    extra: dict = field(default_factory=dict)  # optional tables by file stem: buckets, batch_invariance, routing
    n_prompts: int | None = None
    n_truncated: int = 0
    prompts: list[dict] | None = None  # prompts.jsonl's records (token_ids among them), when the folder has it

    @property
    def is_ablate(self) -> bool:
        return self.ablation is not None

    @property
    def is_generate(self) -> bool:
        return "generate" in self.manifest or (self.tokens is not None and "is_response" in self.tokens)

    @property
    def is_score(self) -> bool:
        """A score run: the logprobs the user's RL run recorded against the trainer's (tokens.csv's logprob_rollout,
        read here as the inference side, logprob_infer), and the engine's prefill when it was measured."""
        return self.manifest.get("kind") == "score"

    @property
    def kind(self) -> str:
        if self.is_score:
            return "score"
        if self.manifest.get("kind") == "remedies":
            return "remedies"
        return "generate" if self.is_generate else "ablate" if self.is_ablate else "compare"

    @property
    def regions(self) -> list[str]:
        listed = self.manifest.get("ablate", {}).get("regions")
        if listed:
            return [r for r in listed if r in self.ablation.columns]
        return [c for c in self.ablation.columns if self.ablation[c].dtype == bool]

    @property
    def metric(self) -> str:
        return self.manifest.get("ablate", {}).get("metric", "mean_kl")

    @property
    def combos(self) -> list[str]:
        return list(self.ablation["combo"]) if self.is_ablate else []

    @property
    def all_aligned(self) -> str | None:
        if not self.is_ablate or not self.regions:
            return None
        full = self.ablation[self.ablation[self.regions].astype(bool).all(axis=1)]
        return str(full["combo"].iloc[0]) if len(full) else None

    @property
    def num_layers(self) -> int | None:
        n = self.manifest.get("model", {}).get("num_layers")
        if isinstance(n, int):
            return n
        from ..taps import LAYER_TAPS

        decoder = self.layers[self.layers["tap"].isin(LAYER_TAPS)]
        return int(decoder["layer"].max()) + 1 if len(decoder) else None


# ---------------------------------------------------------------------------------------------- selections
def row_of(frame: pd.DataFrame, combo: str | None) -> pd.Series:
    if combo is not None and "combo" in frame:
        match = frame[frame["combo"] == combo]
        if len(match):
            return match.iloc[0]
    return frame.iloc[0]


def shipped_rows(df: pd.DataFrame) -> pd.DataFrame:
    """An ablation's per-combination tables (graft, routing) hold every combination: most views show the shipped one."""
    return df[df["combo"] == SHIPPED] if "combo" in df else df


def layers_of(run: RunData, combo: str | None) -> pd.DataFrame:
    if "combo" in run.layers and combo is not None:
        return run.layers[run.layers["combo"] == combo]
    return run.layers


def response_rho(run: RunData) -> np.ndarray | None:
    if run.tokens is None or "is_response" not in run.tokens:
        return None
    t = run.tokens
    if "combo" in t:
        t = t[t["combo"] == SHIPPED]
    return np.exp(t.loc[t["is_response"], "delta_logprob"].to_numpy(dtype=np.float64))
