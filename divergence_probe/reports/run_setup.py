"""The report's setup section: the model, precision and device, each stack with its versions and the settings a
reader compares runs by, the prompts, seed and taps, and what each region ran as on each side."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from ..numerics.shapley import SHIPPED
from .document import Bullets, Column, Heading, Table
from .recorded import setup_items
from .run_data import RunData, row_of
from .wording import _code, _get


def _versions(d: dict | None) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted((d or {}).items())) or "unknown"


ENGINE_CONFIG = ("mode", "backend", "cudagraph_mode", "custom_ops")  # of the compiled engine's configuration
TRAINER_SETTINGS = ("train_sdpa", "train_state", "train_precision", "sdpa_kernel_chosen", "torch_numerics_snapshot")


def _settings(settings: dict) -> str:
    """A stack's settings on one line: plain values as they are; of the nested ones (the engine's compilation
    configuration, per-tap status, torch's numerics state) only what a reader compares runs by, the rest is in
    manifest.json."""
    parts, nested = [], []
    for key, value in sorted(settings.items()):
        if not isinstance(value, dict):
            parts.append(f"{key}={_code(value)}")
        elif key == "compilation":
            parts.append("compilation=" + _code({k: value[k] for k in ENGINE_CONFIG if k in value}))
        elif key in ("sdpa_kernel_chosen", "engine_args"):
            parts.append(f"{key}={_code(value)}")
        else:
            nested.append(f"`{key}`")
    return ", ".join(parts) + (f" ({', '.join(nested)} in manifest.json)" if nested else "")


def setup_section(run: RunData) -> list:
    m = run.manifest
    model, load, env = m.get("model", {}), m.get("load", {}), m.get("environment", {})
    infer, train = _get(m, "stacks", "infer", default={}), _get(m, "stacks", "train", default={})
    items = [
        f"Model: {_code(model.get('spec', 'unknown'))} (architecture `{model.get('arch', 'unknown')}`, "
        f"{model.get('num_layers', 'unknown')} decoder layers"
        + (f", config.json sha256 `{str(model['config_sha256'])[:12]}…`" if model.get("config_sha256") else "") + ")",
        f"Precision and device: `{load.get('dtype', 'unknown')}` on `{load.get('device', 'unknown')}`"
        + (f" ({env['gpu']})" if env.get("gpu") else "") + (f"; CPU {env['cpu']}" if env.get("cpu") else ""),
        *(setup_items(run) if run.is_score else ()),
        *(() if run.is_score and not infer else
          (f"Inference stack: `{infer.get('name', load.get('infer', 'unknown'))}` "
           f"({_versions(infer.get('versions'))})",)),
        f"Training stack: `{train.get('name', load.get('train', 'unknown'))}` ({_versions(train.get('versions'))})"
        + (f", attention `{load['train_attn']}`" if load.get("train_attn") else ""),
    ]
    if infer.get("settings"):
        items.append("Inference settings: " + _settings(infer["settings"]))
    trainer = {k: v for k, v in train.get("settings", {}).items() if k in TRAINER_SETTINGS}
    if trainer:
        items.append("Training settings: " + _settings(trainer))
    prompts = f"{run.n_prompts} prompts" if run.n_prompts is not None else "unknown number of prompts"
    if run.n_truncated:
        prompts += f" ({run.n_truncated} truncated to {_get(m, 'compare', 'max_prompt_tokens')} tokens)"
    source = _get(m, "compare", "prompts")
    n_tokens = row_of(run.summary, SHIPPED).get("n_tokens")
    items.append(f"Prompts: {prompts}" + (f" from {_code(Path(str(source)).name)}" if source else "")
                 + (f", {int(n_tokens)} scored tokens" if n_tokens is not None and not pd.isna(n_tokens) else ""))
    taps = _get(m, "compare", "taps")
    items.append(f"Seed: `{load.get('seed', 'unknown')}`; no taps (score compares token logprobs only)" if run.is_score
                 else f"Seed: `{load.get('seed', 'unknown')}`; divergence threshold (rel_l2): "
                 f"`{_get(m, 'compare', 'threshold', default='unknown')}`; taps captured: "
                 + (f"{len(taps)}" if isinstance(taps, list) else "unknown"))
    if run.is_ablate:
        a = m.get("ablate", {})
        side = {"both": "both stacks", "train": "the training stack only (the engine as shipped)",
                "infer": "the inference stack only"}.get(a.get("side"), str(a.get("side", "unknown")))
        items.append(f"Ablation: regions {', '.join(_code(r) for r in run.regions)} aligned in every "
                     f"combination ({len(run.combos)} runs) on {side}; metric `{run.metric}`; "
                     f"{a.get('bootstrap', 'unknown')} bootstrap draws (seed `{a.get('seed', 'unknown')}`)")
    if "generate" in m:
        g = m["generate"]
        desc = ", ".join(f"{k}={_code(v)}" for k, v in sorted(g.items())) if isinstance(g, dict) else _code(g)
        items.append(f"Generation: {desc}; importance-ratio clip ε = {run.clip_eps:g}")
    if env.get("python") or env.get("platform"):
        items.append(f"Environment: Python {env.get('python', '?')} on {_code(env.get('platform', '?'))}")
    if m.get("command"):
        command = m["command"]
        items.append("Command: " + _code(" ".join(map(str, command)) if isinstance(command, list) else command))
    blocks: list = [Heading("Setup"), Bullets(tuple(items))]

    impl_i, impl_t = infer.get("implementations", {}), train.get("implementations", {})
    regions = list(dict.fromkeys([*impl_i, *impl_t]))
    if regions:
        blocks.append(Table(
            "implementations",
            "What each region ran as, per stack (from the manifest: the function or kernel each stack dispatched to).",
            (Column("region", "code"), Column(f"inference ({infer.get('name', 'infer')})", "longcode"),
             Column(f"training ({train.get('name', 'train')})", "longcode")),
            tuple((r, impl_i.get(r), impl_t.get(r)) for r in regions)))
    return blocks
