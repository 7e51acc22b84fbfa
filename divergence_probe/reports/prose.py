"""The report's text as blocks: the title and introduction, then each section in the order the report shows them
(each in its own module: setup, headline numbers, reference, first divergence, routing, remedies, tables)."""

from __future__ import annotations

from pathlib import Path

from .divergence import first_divergence_section
from .document import Figure, Heading, Paragraph
from .headline import headline_section
from .moe import routing_section
from .recorded import recorded_section
from .reference import reference_section
from .remedies import remedies_section
from .run_data import RunData
from .run_setup import setup_section
from .tables import tables_section
from .wording import _code, _get


def title(run: RunData) -> str:
    spec = str(_get(run.manifest, "model", "spec", default="model"))
    return f"divergence-probe report: {Path(spec).name or spec}, {run.kind} run"


def _intro(run: RunData) -> Paragraph:
    infer = _get(run.manifest, "stacks", "infer", "name", default=_get(run.manifest, "load", "infer", default="inference"))
    if run.is_score:
        engine = " and, re-scored in one prefill, by the inference engine" if _get(run.manifest, "score", "prefill") \
            else ""
        return Paragraph("This report reads the rollouts a user's RL run recorded (prompt and response token ids, the "
                         "logprobs its engine gave while sampling) and sets those logprobs against the ones the same "
                         f"checkpoint gives the same tokens in the training stack (transformers){engine}. Throughout, "
                         "`logprob_infer` is the recorded logprob (tokens.csv's `logprob_rollout`) and Δlogprob = "
                         "logprob_train − logprob_rollout. Run folder: " + _code(run.path.name) + ".")
    what = {"compare": "compares", "ablate": "ablates", "generate": "compares, on generated rollouts,",
            "remedies": "compares, as shipped and with each candidate remedy,"}[run.kind]
    text = (f"This report {what} the same checkpoint run by an inference engine (`{infer}`) and by a training "
            "stack (transformers), fed exactly the same token ids. Both compute in the same dtype, yet they round "
            "intermediate results at different places, so the policy that samples and the policy that is trained "
            "differ slightly; the report shows where the two first differ, how the difference grows through the "
            "layers, and what it does to token logprobs.")
    if run.is_ablate:
        text += (" The ablation reruns the comparison with regions (RoPE, SwiGLU, residual RMSNorm) computed in "
                 "FP32 until their output, in every combination, and attributes the mismatch to them.")
        if "routing" in run.regions:
            text += " Region `routing` is routing replay: the trainer runs the experts the engine chose."
    return Paragraph(text + f" Run folder: {_code(run.path.name)}.")


def build_document(run: RunData, figure_specs: list, skipped: list[str], figure_files: bool = True) -> list:
    """The report's blocks; `figure_files`: whether the figures are also saved as files (not in a self-contained
    HTML report, whose figures are embedded)."""
    blocks: list = [Heading(title(run), 1), _intro(run)]
    blocks += setup_section(run) + headline_section(run) + reference_section(run) + (
        recorded_section(run) if run.is_score else [])
    blocks += first_divergence_section(run)
    blocks += routing_section(run) + remedies_section(run) + tables_section(run)
    blocks.append(Heading("Figures"))
    if figure_specs and figure_files:
        blocks.append(Paragraph("Each figure is also saved as a vector PDF beside its PNG in `figures/`."))
    blocks += [Paragraph(s) for s in skipped]
    blocks += [Figure(f.stem, f.title, f.caption) for f in figure_specs]
    return blocks
