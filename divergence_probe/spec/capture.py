"""CaptureSpec: what is captured and how divergence is judged."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ProbeError
from ..options import option
from .fields import _choice, check_finite
from ..tap_selection import parse_tap_selection
from ..taps import ALL_TAPS

REFERENCES = ("float64", "float32")  # --reference (numerics/reference.py: PRECISIONS)
# Significand bits of the precisions a run names (--dtype, --reference): a reference stands closer to exact than the
# stacks only with more of them (RunSpec checks the two together).
SIGNIFICAND_BITS = {"bfloat16": 8, "float16": 11, "float32": 24, "float64": 53}


@dataclass(frozen=True, kw_only=True)
class CaptureSpec:
    """What is captured and how divergence is judged."""

    taps: str = option("all", "all, none, or a comma list of tap names (" + ", ".join(ALL_TAPS) + ").")
    threshold: float = option(1e-3, "rel_l2 above which a tap counts as diverged (first_over_threshold).")
    batch_invariance: bool = option(False, "Also measure the noise floor: each stack alone vs batched on the same "
                                           "sequences (batch_invariance.csv), and the training stack under another "
                                           "SDPA kernel (kernel_noise.csv); the summary reads the mismatch against "
                                           "the largest floor.")
    graft: bool = option(False, "Also measure each op's local error: the training stack's op on the inference "
                                "stack's captured input of that op, against the inference output (local.csv, "
                                "local_families.csv). Captures every tap; needs --engine eager.")
    depth: bool = option(False, "Also continue the training forward from the inference residual stream entering each "
                                "layer and score it against the inference logits (depth.csv; implies --graft; costs "
                                "about L/2 extra forwards per prompt).")
    engine_noise: bool = option(False, "Also score the sequences on a vLLM engine in the other engine mode (eager if "
                                       "--engine compiled, else compiled; same regions), built in a worker process, "
                                       "and report its mean |Δlogp| to this run's engine (engine_noise.csv): the "
                                       "engine's own eager-vs-compiled gap. A compiled engine built with tap points "
                                       "is also checked against one built without them (tap_points_mean_abs_dlogp: 0 "
                                       "when the taps left its numerics alone). At tensor_parallel_size N > 1: the "
                                       "engine at 1 instead (the parallelism floor). Costs one or two engine builds.")
    reference: str | None = option(None, "Also run the checkpoint in float64 or float32 (transformers, eager attention) "
                                         "on the same token ids under the same capture, and measure each stack's "
                                         "taps and logprobs against it: which side is further from exact where the "
                                         "mismatch starts (layers.csv, tokens.csv and summary.csv's ref_ columns).")

    def __post_init__(self) -> None:
        check_finite(self)
        if self.reference is not None:
            _choice(self.reference, REFERENCES, "--reference")
        if not self.threshold >= 0:
            raise ProbeError("--threshold must be a non-negative number")
        parse_tap_selection(self.taps)

    @property
    def tap_names(self) -> frozenset[str]:
        return parse_tap_selection(self.taps)
