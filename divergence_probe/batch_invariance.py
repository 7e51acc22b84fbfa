"""The noise floor: how much one stack moves its own logprobs when the same sequences run alone vs batched.

A stack's own batch composition can move its logprobs as much as the vLLM-vs-transformers gap
(docs/results/h200/README.md), so a mismatch number means little without this floor beside it.
Each stack scores the same token sequences twice, with no taps: one sequence per call, then all in one
batch (vLLM: one engine step; transformers: one right-padded forward with an attention mask).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd

from .metrics import token_kl
from .prompts import Prompt

COLUMNS = ["stack", "side", "mean_abs_dlogp", "max_abs_dlogp", "mean_kl", "max_kl", "n_tokens", "batch_size"]


def _ignore(*_) -> None:
    pass


def measure(probe, sequences: Sequence[Prompt]) -> pd.DataFrame:
    rows = []
    for side, stack in (("infer", probe.infer), ("train", probe.train)):
        together = {s.prompt_id: s for s in stack.score_batched(sequences)}
        deltas, kls = [], []
        for seq in sequences:
            [alone] = stack.score([seq], frozenset(), _ignore)
            batched = together[seq.prompt_id]
            deltas.append((batched.logprobs.double().cpu() - alone.logprobs.double().cpu()).abs().numpy())
            kls.append(token_kl(alone.logits, batched.logits.to(alone.logits.device)).cpu().numpy())
        d, k = np.concatenate(deltas), np.concatenate(kls)
        rows.append({"stack": stack.name, "side": side, "mean_abs_dlogp": float(d.mean()),
                     "max_abs_dlogp": float(d.max()), "mean_kl": float(k.mean()), "max_kl": float(k.max()),
                     "n_tokens": int(d.size), "batch_size": len(sequences)})
    return pd.DataFrame(rows, columns=COLUMNS)
