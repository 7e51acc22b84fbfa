"""The run specs: one frozen tree per run kind that says everything the run does; the CLI's flags and the manifest
come from it.

    spec = RunSpec(kind="compare", load=LoadSpec(model="ckpt/"), capture=CaptureSpec(taps="none"))
    run = divergence_probe.run(spec)          # or: divergence-probe rerun RUN_DIR

The components (load, prompts, capture, generate, align) each own their fields, defaults and checks; the run kinds
compose them: RunSpec (compare, ablate: run.py), ScoreSpec (score.py, beside a LoadSpec), RLSpec (rl.py).
from_manifest.py reads a recorded spec back with the checks its flags get; fields.py holds what they share.
"""

from .align import AblateSpec, AlignSpec
from .capture import CaptureSpec
from .fields import flag_of
from .from_manifest import LATER_FIELDS, recorded, recorded_value
from .generate import GenerateSpec
from .load import LoadSpec
from .prompts import PromptSpec
from .run import COMPONENTS, RunSpec, check_family, flat_fields, spec_from_flat

__all__ = ["AblateSpec", "AlignSpec", "CaptureSpec", "COMPONENTS", "GenerateSpec", "LATER_FIELDS", "LoadSpec",
           "PromptSpec", "RunSpec", "check_family", "flag_of", "flat_fields", "recorded", "recorded_value",
           "spec_from_flat"]
