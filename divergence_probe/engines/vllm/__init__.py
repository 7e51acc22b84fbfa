"""The inference stack: vLLM, one concept per module.

- stack.py: VLLMStack, the engine in this process (eager or compiled), its scoring and sampling, the engine args it
  owns, and the checks of captured logits against vLLM's own logprobs.
- layouts.py: where vLLM keeps each family's modules, its seams, its fused GEMMs and experts (engines/layouts.py).
- patches/: the region patches on vLLM's modules, one module per region.
- seams.py: where each canonical tap is read on vLLM's modules (shared by the eager hooks and the compiled tap points).
- compiled_taps.py: tap points inside a compiled graph (a custom op and static buffers).
- rollout.py: the decode path's captures, stitched per sequence across engine steps.
- aligned.py: an engine built with regions aligned (a compiled graph traces its regions in).
- worker.py: an engine in a worker process (vLLM's CPU backend hosts one engine per process).
- weights.py: an RL loop's weight push into the running engine, its proof, the stale-cache probe.
- replayable.py: the engine args a run folder may replay without asking.
"""
