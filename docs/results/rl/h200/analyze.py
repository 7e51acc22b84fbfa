"""The tables of docs/results/rl/h200/README.md, from the run folders' rl.csv (the CPU study's per-run table, reused).

    PYTHONPATH=/work/main /work/main/.venv/bin/python docs/results/rl/h200/analyze.py
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pandas as pd

HERE = Path(__file__).resolve().parent
RUNS = ["train-none", "train-rope", "train-all3", "both-all3", "moe-compiled", "moe-eager"]
MOE = ["moe-compiled", "moe-eager"]
_spec = importlib.util.spec_from_file_location("cpu_analyze", HERE.parent / "analyze.py")
cpu_analyze = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cpu_analyze)


def rows() -> pd.DataFrame:
    return pd.concat([pd.read_csv(HERE / run / "rl.csv").assign(run=run) for run in RUNS], ignore_index=True)


def first_steps(all_rows: pd.DataFrame, steps: int = 20) -> pd.DataFrame:
    """Mismatch while the policy still samples (the first `steps` steps), and when reward first reached 0.99; for a
    mixture of experts also the share of response tokens the trainer's router sent elsewhere than the engine's."""
    out = []
    for (run, setting, seed), run_rows in all_rows.groupby(["run", "setting", "seed"], sort=False):
        early = run_rows[run_rows.step <= steps]
        solved = run_rows[run_rows.reward_mean >= 0.99].step
        row = {"run": run, "setting": setting, "seed": seed, "steps": len(run_rows),
               "dlogp step 1": run_rows.mean_abs_dlogp.iloc[0],
               f"dlogp steps 1-{steps}": early.mean_abs_dlogp.mean(), f"k3 steps 1-{steps}": early.k3.mean(),
               f"ppo_clip_frac steps 1-{steps}": early.ppo_clip_frac.mean(),
               f"frac |dlogp|>ln2 steps 1-{steps}": early.frac_abs_dlogp_over_ln2.mean(),
               "first step reward >= 0.99": int(solved.min()) if len(solved) else None,
               "entropy at that step": float(run_rows.loc[run_rows.step == solved.min(), "entropy"].iloc[0])
               if len(solved) else None}
        if run in MOE:
            row[f"routing flips steps 1-{steps}"] = early.frac_response_any_flip.mean()
            row["steps with an EOS"] = int((run_rows.eos_frac > 0).sum())
        out.append(row)
    return pd.DataFrame(out)


def replay_pairs(all_rows: pd.DataFrame) -> pd.DataFrame:
    """Step 1 of each seed of a MoE run: both settings score the very same sampled tokens, so routing replay's
    effect on the mismatch is a paired difference."""
    first = all_rows[all_rows.run.isin(MOE) & (all_rows.step == 1)]
    table = first.pivot_table(index=["run", "seed"], columns="setting", values="mean_abs_dlogp").dropna()
    table["routing / none"] = table["routing"] / table["none"]
    return table.reset_index().rename(columns={"none": "dlogp none", "routing": "dlogp routing"})


def main() -> None:
    all_rows = rows()
    pd.set_option("display.width", 250)
    for run in RUNS:
        print(f"\n### {run}\n")
        print(cpu_analyze.markdown(cpu_analyze.per_run(all_rows[all_rows.run == run])))
    print("\n### first steps\n")
    print(cpu_analyze.markdown(first_steps(all_rows).astype(object).fillna("-")))
    print("\n### routing replay at step 1 (paired)\n")
    print(cpu_analyze.markdown(replay_pairs(all_rows)))


if __name__ == "__main__":
    main()
