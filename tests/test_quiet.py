"""The API quiets the libraries' own output as the CLI does (quiet.py), while it loads and runs, unless quiet=False;
toy stacks (no engine)."""

from __future__ import annotations

import logging
import os

import pytest

import divergence_probe as dp
from divergence_probe import quiet as quiet_mod
from divergence_probe.quiet import ENVIRONMENT


@pytest.fixture
def unset(monkeypatch):
    """No quieting set by the user or by an earlier CLI call in this process."""
    for name, _ in ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(quiet_mod, "_shown", False)
    monkeypatch.setattr(logging.getLogger("transformers"), "level", logging.NOTSET)


@pytest.mark.parametrize("quiet", [True, False])
def test_load_and_run_quiet_the_libraries_unless_told_not_to(toy, qwen3_tiny, prompts_file, unset, caplog, quiet):
    seen = {}

    def before_stacks(source, tokenizer):  # inside load, before the stacks load
        seen["env"] = {name: os.environ.get(name) for name, _ in ENVIRONMENT}
        logging.getLogger("transformers.modeling_utils").warning("a library warning during load")

    probe = dp.load(str(qwen3_tiny), infer="toy-fused", train="toy", device="cpu", before_stacks=before_stacks,
                    quiet=quiet)
    probe.compare(prompts=prompts_file, taps="none",
                  progress=lambda done, total: logging.getLogger("vllm.engine").warning("a library warning in a run"))
    logged = caplog.messages  # what reached the root logger: the libraries' records not dropped by their level
    assert seen["env"] == {name: (value if quiet else None) for name, value in ENVIRONMENT}
    assert ("a library warning during load" in logged) is not quiet
    assert ("a library warning in a run" in logged) is not quiet
    assert {name: os.environ.get(name) for name, _ in ENVIRONMENT} == {name: None for name, _ in ENVIRONMENT}
    assert logging.getLogger("transformers").level == logging.NOTSET  # the caller's logging, as it was
