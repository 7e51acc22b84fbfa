"""The tables of docs/results/rl/h200/README.md, from the run folders' rl.csv (the CPU study's per-run table, reused).

    PYTHONPATH=/work/main /work/main/.venv/bin/python docs/results/rl/h200/analyze.py
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pandas as pd

HERE = Path(__file__).resolve().parent
RUNS = ["train-none", "train-rope", "train-all3", "both-all3"]
_spec = importlib.util.spec_from_file_location("cpu_analyze", HERE.parent / "analyze.py")
cpu_analyze = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cpu_analyze)


def rows() -> pd.DataFrame:
    return pd.concat([pd.read_csv(HERE / run / "rl.csv").assign(run=run) for run in RUNS], ignore_index=True)


def first_steps(all_rows: pd.DataFrame, steps: int = 20) -> pd.DataFrame:
    """Mismatch while the policy still samples (the first `steps` steps), and when reward first reached 0.99."""
    out = []
    for (run, seed), run_rows in all_rows.groupby(["run", "seed"], sort=False):
        early = run_rows[run_rows.step <= steps]
        solved = run_rows[run_rows.reward_mean >= 0.99].step
        out.append({"run": run, "seed": seed, "dlogp step 1": run_rows.mean_abs_dlogp.iloc[0],
                    f"dlogp steps 1-{steps}": early.mean_abs_dlogp.mean(), f"k3 steps 1-{steps}": early.k3.mean(),
                    f"ppo_clip_frac steps 1-{steps}": early.ppo_clip_frac.mean(),
                    f"frac |dlogp|>ln2 steps 1-{steps}": early.frac_abs_dlogp_over_ln2.mean(),
                    "first step reward >= 0.99": int(solved.min()) if len(solved) else None,
                    "entropy at that step": float(run_rows.loc[run_rows.step == solved.min(), "entropy"].iloc[0])
                    if len(solved) else None})
    return pd.DataFrame(out)


def main() -> None:
    all_rows = rows()
    pd.set_option("display.width", 250)
    for run in RUNS:
        print(f"\n### {run}\n")
        print(cpu_analyze.markdown(cpu_analyze.per_run(all_rows[all_rows.run == run])))
    print("\n### first steps\n")
    print(cpu_analyze.markdown(first_steps(all_rows)))


if __name__ == "__main__":
    main()
