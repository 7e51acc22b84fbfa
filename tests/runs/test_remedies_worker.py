"""remedies' engine step timed where the engine runs: an engine in a worker process (as the FP16 arm's vLLM engine)
times its own call there, so the hand-over of its outputs to this process is no part of its step. One eager vLLM
worker on the tiny model beside the two-transformers probe's trainer."""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

import pytest

from divergence_probe.runs import remedies, remedy_cost
from divergence_probe.spec.run import spec_from_flat

pytestmark = pytest.mark.engine

REPEATS = 2


def test_an_engine_in_a_worker_is_timed_there_not_around_the_round_trip(hf_probe, prompts_file):
    from divergence_probe.engines.vllm.worker import WorkerStack

    round_trips = []

    def engine_step(view, prompts):  # the round trip from this process: the call, and its outputs' hand-over
        start = time.perf_counter()
        remedy_cost.STEPS["engine_step"](view, prompts)
        round_trips.append(time.perf_counter() - start)

    prompts = hf_probe.run_prompts(spec_from_flat("compare", load=hf_probe.config,
                                                  prompts=str(prompts_file), num_prompts=2))[1]
    with WorkerStack(hf_probe.settings) as worker:
        worker.load(hf_probe.settings)
        cost = remedy_cost.measure_cost(replace(hf_probe, infer=worker), prompts, REPEATS, {"engine_step": engine_step})
    assert 0 < cost["engine_step_s"] < statistics.median(round_trips[1:])  # the warm-up's left out
    assert cost["engine_step_timed_in"] == "worker"
