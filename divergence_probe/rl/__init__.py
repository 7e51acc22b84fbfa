"""`divergence-probe rl`: a small GRPO loop (vLLM rollouts, transformers updates, weight sync verified every step).

    import divergence_probe.rl as rl
    result = rl.run(rl.RLSpec(steps=20), out_dir="runs/rl")       # rl.csv, rl_summary.csv, manifest.json
    spec = rl.rl_spec(model="ckpt/", steps=20, engine="compiled")   # by option names, as the flags give them

Modules: reward (the task, plug-ins), grpo (advantages, loss), trainer (FP32 masters, BF16 compute), loop (the
steps: rollouts, pushes and their proofs through the engine's RolloutEngine protocol), experiment (settings x seeds on
one engine), table (the run folder); its options are spec/rl.py. The weight push and its proofs are the engine's
(engines/vllm/weights.py; the engine-neutral comparison: engines/weight_check.py).
"""

from ..lazy import lazy_exports

__all__ = ["Loop", "RLResult", "RLSpec", "StaleCacheError", "SyncError", "load", "rl_spec", "run"]

# The API's names are imported on first use (PEP 562): `rl --help` reads spec/rl.py alone, without torch or vLLM.
_LAZY = {"run": ".experiment", "RLResult": ".experiment", "Loop": ".loop", "load": ".loop", "RLSpec": "..spec.rl",
         "rl_spec": "..spec.rl",
         "StaleCacheError": "..errors", "SyncError": "..errors"}


__getattr__, __dir__ = lazy_exports(__name__, globals(), _LAZY)
