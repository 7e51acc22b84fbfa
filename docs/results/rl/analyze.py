"""The tables and the per-run figure of docs/results/rl/README.md, computed from the two run folders' rl.csv.

    PYTHONPATH=/work/main /work/main/.venv/bin/python docs/results/rl/analyze.py

Prints markdown tables and writes runs.png beside this file (one column per run folder: reward, policy entropy and
mean |Δlogp| against step, a line per (setting, seed), 10-step rolling means; the report command's figure draws the
mean over seeds with the seeds' range as a band, which hides which run did what). A folder without manifest.json (a run that did not finish) gets the report
command's own figure drawn from its rows unchecked (`write_rl_report(folder, check=False)`), as `rl` does for a
stopped run.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

HERE = Path(__file__).resolve().parent
FOLDERS = {"side train": HERE / "cpu-side-train", "side both": HERE / "cpu-side-both",
           "side train, no-signal steps skipped": HERE / "cpu-side-train-skip"}
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
            "dlogp step 1": run.mean_abs_dlogp.iloc[0],
            "dlogp start": head.mean_abs_dlogp.mean(), "dlogp end": tail.mean_abs_dlogp.mean(),
            "k3 end": tail.k3.mean(),
            "entropy start": head.entropy.mean(), "entropy end": tail.entropy.mean(),
            "s/step (median)": (run[WORK].sum(axis=1) + run[OVERHEAD].sum(axis=1)).median(),
            "overhead_frac (median)": run.overhead_frac.median(),
            "zero-gradient steps": int((run.grad_norm == 0).sum()),
            "reward-0 steps": int((run.reward_mean == 0).sum()),
            "optimizer steps skipped": int((~run.optimizer_stepped.astype(bool)).sum())
            if "optimizer_stepped" in run else "-",
        })
    return pd.DataFrame(out)


def by_entropy(rows: pd.DataFrame) -> pd.DataFrame:
    """Per-step mismatch against the policy's entropy on the sampled positions, in entropy buckets (medians)."""
    bucket = pd.cut(rows.entropy, [0, 0.01, 0.03, 0.1, 0.3, 1, 2, 3, 4, 6])
    table = rows.groupby(bucket, observed=True).agg(
        steps=("step", "size"), mean_abs_dlogp=("mean_abs_dlogp", "median"), max_abs_dlogp=("max_abs_dlogp", "median"),
        k3=("k3", "median"), ppo_clip_frac=("ppo_clip_frac", "mean")).reset_index()
    table.insert(0, "entropy (nats)", table.pop("entropy").astype(str))
    return table


def step_one(rows: pd.DataFrame) -> pd.DataFrame:
    """Step 1 of each seed: mean |Δlogp| and k3 per setting, and mean |Δlogp| relative to `none` when present."""
    first = rows[rows.step == 1]
    out = first.pivot(index="setting", columns="seed", values="mean_abs_dlogp")
    k3 = first.pivot(index="setting", columns="seed", values="k3")
    table = pd.DataFrame(index=out.index)
    for seed in out.columns:
        table[f"seed {seed}"] = out[seed]
        if "none" in out.index:
            table[f"÷ none, seed {seed}"] = out[seed] / out.loc["none", seed]
        table[f"k3 seed {seed}"] = k3[seed]
    order = [s for s in rows.setting.drop_duplicates()]
    return table.loc[order].reset_index()


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
    fig, axes = plt.subplots(len(panels), len(runs), figsize=(4.2 * len(runs), 7.2), sharex=True, sharey="row", squeeze=False)
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
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=80)


def main() -> None:
    runs = {name: pd.read_csv(folder / "rl.csv") for name, folder in FOLDERS.items() if (folder / "rl.csv").is_file()}
    for name, rows in runs.items():
        print(f"## {name}: {len(rows)} rows, NaN cells {int(rows.isna().sum().sum())}, "
              f"sync_tensors {sorted(rows.sync_tensors.unique())}, stale_probe_moved {rows.stale_probe_moved.mean():.3f}, "
              f"sync_changed min {rows.sync_changed.min()} (on zero-gradient steps: "
              f"{rows[rows.grad_norm == 0].sync_changed.min() if (rows.grad_norm == 0).any() else '-'})\n")
        print(markdown(per_run(rows)), "\n")
        print(markdown(step_one(rows)), "\n")
        print(markdown(by_entropy(rows)), "\n")
        medians = rows[WORK + OVERHEAD + ["t_checksums", "t_probe"]].median()
        print("per-step medians (s):", ", ".join(f"{k} {v:.3g}" for k, v in medians.items()), "\n")
        peak = rows.loc[rows.ppo_clip_frac.idxmax()]
        print(f"largest ppo_clip_frac {peak.ppo_clip_frac:.3g} ({peak.setting} seed {peak.seed} step {peak.step}); "
              f"ratio range {rows.ratio_min.min():.3g}..{rows.ratio_max.max():.3g}; ESS min {rows.ess.min():.4f}; "
              f"spearman(entropy, mean |Δlogp|) {rows[['entropy', 'mean_abs_dlogp']].corr('spearman').iloc[0, 1]:.3f}\n")
    figure(runs, HERE / "runs.png")
    for folder in FOLDERS.values():  # a run that did not finish has no manifest, so `report` refuses it: the same
        if (folder / "rl.csv").is_file() and not (folder / "manifest.json").is_file():  # figure, rows unchecked
            from divergence_probe.reports.rl import write_rl_report

            print("unfinished run drawn:", write_rl_report(folder, check=False))


if __name__ == "__main__":
    main()
