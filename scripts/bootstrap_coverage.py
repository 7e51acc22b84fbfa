"""How often the noise verdict's 95% interval holds the true ratio, by number of prompts: the measurement behind
MIN_PROMPTS (docs/reference/outputs.md, "How many prompts"). Synthetic per-prompt |Δlogp| sums, lognormal (σ = 1) for the
mismatch at 1.5 times the floor's scale, ten tokens a prompt; the interval as the tool computes it
(noise_verdict.paired_ratio_interval), and, for comparison, with the floor held at its mean as older versions did.

    python scripts/bootstrap_coverage.py [--trials 300] [--draws 400]
"""

from __future__ import annotations

import argparse

import numpy as np
import pandas as pd

from divergence_probe.numerics import shapley
from divergence_probe.numerics.noise_verdict import paired_ratio_interval

TRUE_RATIO = 1.5


def coverage(n: int, trials: int, draws: int, held: bool, rng) -> float:
    hits = 0
    for trial in range(trials):
        mismatch = pd.DataFrame({"n": 10, "sum_abs_dlogp": 10 * TRUE_RATIO * rng.lognormal(0, 1, n)})
        floor = rng.lognormal(0, 1, n)
        floor = pd.DataFrame({"n": 10, "sum_abs_dlogp": 10 * (np.full(n, floor.mean()) if held else floor)})
        low, high = paired_ratio_interval(mismatch, floor, trial, draws)
        hits += low <= TRUE_RATIO <= high
    return hits / trials


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=300)
    parser.add_argument("--draws", type=int, default=400)
    args = parser.parse_args()
    shapley.MIN_PROMPTS = 1  # measure below the rule too
    rng = np.random.default_rng(0)
    print("prompts  paired  floor held")
    for n in (4, 10, 20, 40):
        paired = coverage(n, args.trials, args.draws, False, rng)
        held = coverage(n, args.trials, args.draws, True, rng)
        print(f"{n:7d}  {paired:6.2f}  {held:10.2f}")


if __name__ == "__main__":
    main()
