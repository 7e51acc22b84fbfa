"""Runs `python -m divergence_probe ARGS` with vLLM's engine start held inside `LLM(...)` until a signal arrives.

The hold sits in EngineCore._initialize_kv_caches (the model is loaded, the rendezvous file exists, the engine is
not yet up) and first creates the file named by $HOLD_MARKER. A test that waits for that file and then signals
knows the signal lands in the engine start, on any machine load: no sleep that races the start. The signal
unwinds through vLLM's own start-up frames (core.py, core_client.py, llm_engine.py, llm.py), as a real one would.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import divergence_probe.engines.vllm.stack as vllm_stack
from divergence_probe.cli import main

HOLD_LIMIT_S = 300  # no signal by then: fail loudly (the engine start error is exit 2, not the 143 the test wants)

_import_vllm = vllm_stack._import_vllm


def _import_and_hold():
    """vLLM is imported where the stack imports it (its environment set first), then the hold is installed."""
    vllm = _import_vllm()
    from vllm.v1.engine.core import EngineCore

    def held(self, *args, **kwargs):
        Path(os.environ["HOLD_MARKER"]).touch()
        deadline = time.monotonic() + HOLD_LIMIT_S
        while time.monotonic() < deadline:
            time.sleep(0.05)
        raise RuntimeError(f"no signal arrived within {HOLD_LIMIT_S} s of the held engine start")

    EngineCore._initialize_kv_caches = held
    return vllm


vllm_stack._import_vllm = _import_and_hold
sys.argv = ["divergence-probe", *sys.argv[1:]]
main()
