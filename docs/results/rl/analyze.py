"""The tables and the per-run figure of docs/results/rl/README.md, computed from the two run folders' rl.csv.

    PYTHONPATH=/work/main /work/main/.venv/bin/python docs/results/rl/analyze.py

Prints markdown tables and writes runs.png beside this file (one column per run folder: reward, policy entropy and
mean |Δlogp| against step, a line per (setting, seed), 10-step rolling means; the report command's figure draws the
mean over seeds with the seeds' range as a band, which hides which run did what).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

HERE = Path(__file__).resolve().parent
FOLDERS = {"side train": HERE / "cpu-side-train", "side both": HERE / "cpu-side-both"}
WINDOW = 10  # as rl_summary.csv: the first and the last 10 steps of a run
WORK = ["t_rollout", "t_reward", "t_update"]
OVERHEAD = ["t_metrics", "t_sync", "t_check"]


def per_run(rows: pd.DataFrame) -> pd.DataFrame:
    out = []
    for (setting, seed), run in rows.groupby(["setting", "seed"], sort=False):
        head, tail = run.head(WINDOW), run.tail(WINDOW)
        out.append({
            "setting": setting, "seed": seed, "steps": len(run),
            "reward start": head.reward_mean.mean(), "reward end": tail.reward_mean.mean(),
            "reward max": run.reward_mean.max(),
            "|Δlogp| step 1": run.mean_abs_dlogp.iloc[0],
            "|Δlogp| start": head.mean_abs_dlogp.mean(), "|Δlogp| end": tail.mean_abs_dlogp.mean(),
            "k3 end": tail.k3.mean(),
            "entropy start": head.entropy.mean(), "entropy end": tail.entropy.mean(),
            "s/step (median)": (run[WORK].sum(axis=1) + run[OVERHEAD].sum(axis=1)).median(),
            "overhead_frac (median)": run.overhead_frac.median(),
            "zero-gradient steps": int((run.grad_norm == 0).sum()),
            "reward-0 steps": int((run.reward_mean == 0).sum()),
        })
    return pd.DataFrame(out)


def markdown(table: pd.DataFrame) -> str:
    def cell(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.2e}"
        return str(v)
    head = "| " + " | ".join(table.columns) + " |\n|" + "---|" * len(table.columns)
    return head + "".join("\n| " + " | ".join(cell(v) for v in row) + " |" for row in table.itertuples(index=False))


def figure(runs: dict[str, pd.DataFrame], path: Path) -> None:
    panels = [("reward_mean", "mean reward", False), ("entropy", "policy entropy (nats)", True),
              ("mean_abs_dlogp", "mean |Δlogp|", True)]
    fig, axes = plt.subplots(len(panels), len(runs), figsize=(4.2 * len(runs), 7.2), sharex=True, squeeze=False)
    colors = {"none": "black", "rope": "tab:blue", "rope,swiglu,rmsnorm": "tab:orange"}
    styles = ["-", "--", ":"]
    for col, (name, rows) in enumerate(runs.items()):
        for (setting, seed), run in rows.groupby(["setting", "seed"], sort=False):
            for row, (column, label, log) in enumerate(panels):
                ax = axes[row][col]
                ax.plot(run.step, run[column].rolling(WINDOW, min_periods=1).mean(), color=colors.get(setting, "grey"),
                        linestyle=styles[int(seed) % 3], linewidth=1, label=f"{setting} s{seed}")
                ax.set_yscale("log" if log else "linear")
                ax.set_ylabel(label if col == 0 else "")
        axes[0][col].set_title(name)
        axes[-1][col].set_xlabel("step")
    axes[0][0].legend(fontsize=6, ncol=1, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main() -> None:
    runs = {name: pd.read_csv(folder / "rl.csv") for name, folder in FOLDERS.items() if (folder / "rl.csv").is_file()}
    for name, rows in runs.items():
        print(f"## {name}: {len(rows)} rows, NaN cells {int(rows.isna().sum().sum())}, "
              f"sync_tensors {sorted(rows.sync_tensors.unique())}, stale_probe_moved {rows.stale_probe_moved.mean():.3f}, "
              f"sync_changed min {rows.sync_changed.min()} (on zero-gradient steps: "
              f"{rows[rows.grad_norm == 0].sync_changed.min() if (rows.grad_norm == 0).any() else '-'})\n")
        print(markdown(per_run(rows)), "\n")
        medians = rows[WORK + OVERHEAD + ["t_checksums", "t_probe"]].median()
        print("per-step medians (s):", ", ".join(f"{k} {v:.3g}" for k, v in medians.items()), "\n")
        peak = rows.loc[rows.ppo_clip_frac.idxmax()]
        print(f"largest ppo_clip_frac {peak.ppo_clip_frac:.3g} ({peak.setting} seed {peak.seed} step {peak.step}); "
              f"ratio range {rows.ratio_min.min():.3g}..{rows.ratio_max.max():.3g}; ESS min {rows.ess.min():.4f}; "
              f"spearman(entropy, mean |Δlogp|) {rows[['entropy', 'mean_abs_dlogp']].corr('spearman').iloc[0, 1]:.3f}\n")
    figure(runs, HERE / "runs.png")


if __name__ == "__main__":
    main()
