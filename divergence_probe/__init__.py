"""divergence-probe: where do vLLM and the transformers training stack round differently?

Python API (the CLI is a thin shell over it):

    import divergence_probe as dp
    probe = dp.load("path/or/hub-id", infer="vllm", dtype="bfloat16")   # both stacks, loaded once
    run = probe.compare(taps="all")            # diff every tap and token of the packaged sample prompts
    run.write("runs/my-run")                                             # CSVs + manifest, atomically
    dp.write_report("runs/my-run")                                       # figures + report.md
    dp.Gate.parse(["mean_kl>1e-3"], "compare").judge([("run", run.summary)])  # a CI verdict (--fail-if)
    dp.diff_runs("runs/before", "runs/after").write("runs/what-moved")    # what moved between two runs
"""


from .errors import ProbeError
from .lazy import lazy_exports

__version__ = "0.1.0"
__all__ = ["load", "run", "Probe", "LoadConfig", "ProbeError", "write_report", "RunSpec", "LoadSpec", "PromptSpec",
           "CaptureSpec", "GenerateSpec", "AlignSpec", "AblateSpec", "Gate", "diff_runs", "score_steps", "step_files",
           "__version__"]

# The API's names are imported on first use (PEP 562), so importing the package, or the CLI for its --help, does
# not import torch.
_LAZY = {"load": ".runs.probe", "run": ".runs.probe", "Probe": ".runs.probe", "LoadConfig": ".runs.probe", "write_report": ".reports",
         "Gate": ".reports.gate", "diff_runs": ".reports.diff", "score_steps": ".runs.score", "step_files": ".runs.history",
         **{name: ".spec" for name in ("RunSpec", "LoadSpec", "PromptSpec", "CaptureSpec", "GenerateSpec",
                                       "AlignSpec", "AblateSpec")}}


__getattr__, __dir__ = lazy_exports(__name__, globals(), _LAZY)
