"""A generate-mode run writes its samples in each framework's rollout layout; each layout reads back, detected as
itself, as the same sample (rollouts/adapters.py: every adapter's `write` is the inverse of its `read`)."""

import pytest

from divergence_probe.rollouts.adapters import ADAPTERS, choose, export_row
from divergence_probe.rollouts.formats import EXPORT_FORMATS, FRAMEWORKS
from divergence_probe.spec import GenerateSpec
from divergence_probe.errors import ProbeError

PROMPT, RESPONSE, LOGPROBS, GROUP = [11, 12, 13], [21, 22], [-0.5, -1.25], 7


@pytest.mark.parametrize("fmt", EXPORT_FORMATS)
def test_each_layout_reads_back_as_itself_and_the_same_sample(fmt):
    row = export_row(fmt, PROMPT, RESPONSE, LOGPROBS, GROUP)
    adapter = choose("auto", {}, row)
    assert adapter.name == fmt
    sample = adapter.read(row, 0)
    assert (list(sample.prompt_ids), list(sample.response_ids), list(sample.logprobs), sample.group) == (
        PROMPT, RESPONSE, LOGPROBS, GROUP)


def test_every_framework_layout_can_be_exported():
    """The layout names a spec offers (formats.py, import-free) are the adapters', in their order, and the generic."""
    assert tuple(ADAPTERS) == FRAMEWORKS and EXPORT_FORMATS == (*FRAMEWORKS, "generic")
    assert all(a.write is not None for a in ADAPTERS.values())


def test_an_unknown_layout_is_refused_by_the_spec():
    with pytest.raises(ProbeError, match="--rollouts-format 'nemo'"):
        GenerateSpec(rollouts_format="nemo")
