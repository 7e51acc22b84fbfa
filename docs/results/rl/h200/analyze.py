"""The tables and the figure (runs.png) of docs/results/rl/h200/README.md, from the run folders' rl.csv (the CPU
study's per-run table, reused).

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


# The figure's panels: which runs share one (the same engine mode and side: their first steps are paired), and the
# largest noise floor measured against that engine at the starting checkpoint (generate mode, rl's sampling shape).
PANELS = {
    "0.5B, compiled engine, side train": (["train-none", "train-rope", "train-all3"],
                                          "floor-compiled-generate/summary.csv"),
    "0.5B, eager engine, side both": (["both-all3"], "floor-eager-generate/summary.csv"),
    "tiny MoE, compiled engine": (["moe-compiled"], None),
    "tiny MoE, eager engine": (["moe-eager"], None),
}
COLORS = {"none": "black", "rope": "tab:blue", "rope,swiglu,rmsnorm": "tab:orange", "routing": "tab:green"}
FLOORS = ["noise_infer_mean_abs_dlogp", "noise_train_mean_abs_dlogp", "noise_train_kernel_mean_abs_dlogp",
          "noise_infer_engine_mode_mean_abs_dlogp"]


def figure(all_rows: pd.DataFrame, path: Path) -> None:
    """Reward and mean |Δlogp| per step: the median over seeds of a 10-step rolling mean, the band from the lowest to
    the highest seed, and the largest noise floor as a dashed line where one was measured."""
    plt = cpu_analyze.plt
    fig, axes = plt.subplots(2, len(PANELS), figsize=(4.2 * len(PANELS), 6.0), sharex=True, sharey="row")
    for col, (title, (runs, floor_csv)) in enumerate(PANELS.items()):
        for (run, setting), part in all_rows[all_rows.run.isin(runs)].groupby(["run", "setting"], sort=False):
            for row, (column, log) in enumerate([("reward_mean", False), ("mean_abs_dlogp", True)]):
                smooth = part.pivot(index="step", columns="seed", values=column).rolling(10, min_periods=1).mean()
                ax = axes[row][col]
                color = COLORS.get(setting, "grey")
                ax.fill_between(smooth.index, smooth.min(axis=1), smooth.max(axis=1), color=color, alpha=0.2,
                                linewidth=0)
                ax.plot(smooth.index, smooth.median(axis=1), color=color, linewidth=1,
                        label=f"{setting} ({part.seed.nunique()} seeds)")
                ax.set_yscale("log" if log else "linear")
        if floor_csv:
            summary = pd.read_csv(HERE / floor_csv).iloc[0]
            floor = max(summary[c] for c in FLOORS if c in summary and pd.notna(summary[c]))
            axes[1][col].axhline(floor, color="red", linestyle="--", linewidth=1, label="largest noise floor, step 0")
        axes[0][col].set_title(title, fontsize=9)
        axes[1][col].set_xlabel("step")
        axes[1][col].legend(fontsize=6, frameon=False, loc="lower left")
    axes[0][0].set_ylabel("mean reward")
    axes[1][0].set_ylabel("mean |Δlogp| (sampled tokens)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)


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
    figure(all_rows, HERE / "runs.png")


if __name__ == "__main__":
    main()
