"""Where a compiled engine with tap points keeps its compiled graph between processes (compiled_taps.cache_namespace):
a later process with the same tap points and hook code finds it, and a change of either is a miss, never another
graph served. Model-free: the namespace is computed from the tap set and the source files alone."""

from __future__ import annotations

from pathlib import Path

from divergence_probe.engines.vllm.compiled_taps import CACHE_SUBDIR, NEUTRAL, ROUTER, cache_namespace

ALL = frozenset(NEUTRAL + ROUTER)


def test_a_tapped_build_compiles_under_a_root_of_its_own(monkeypatch, tmp_path):
    """The untapped engine compiles into the user's root (vLLM as deployed); a tapped one never does."""
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    tapped = Path(cache_namespace(ALL))
    assert tapped.parent == tmp_path / CACHE_SUBDIR and tapped != tmp_path
    assert cache_namespace(ALL) == str(tapped)  # the same key in a later process: the graph is found again


def test_each_set_of_tap_points_is_a_key_of_its_own(tmp_path):
    root = str(tmp_path)
    mlp, attn = cache_namespace(frozenset({"mlp_out"}), root), cache_namespace(frozenset({"attn_out"}), root)
    both = cache_namespace(frozenset({"mlp_out", "attn_out"}), root)
    assert len({mlp, attn, both}) == 3
    # taps taken outside the graph make no tap point: the same graph, the same key
    assert cache_namespace(frozenset({"mlp_out", "logits", "embed"}), root) == mlp


def test_an_edit_to_the_hook_code_is_a_miss(monkeypatch, tmp_path):
    """The graph inlines the hooks: edited hook code (seams.py reads each tap off its module) compiles anew."""
    before = cache_namespace(ALL, str(tmp_path))
    real = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: real(self) + (b"# edited" if self.name == "seams.py" else b""))
    assert cache_namespace(ALL, str(tmp_path)) != before


def test_on_cuda_a_tapped_build_saves_no_graph(monkeypatch, tmp_path):
    """vLLM 0.24 on CUDA cannot serialize the tapped graph and fails the engine's start when its cache is on: there
    the build runs with the cache off; on the CPU build it compiles under its own root."""
    from divergence_probe.engines.vllm.compiled_taps import cache_environment

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    assert cache_environment(ALL, "cuda") == {"VLLM_DISABLE_COMPILE_CACHE": "1"}
    assert cache_environment(ALL, "cpu") == {"VLLM_CACHE_ROOT": cache_namespace(ALL)}
