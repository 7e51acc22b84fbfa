"""The tap reduction's per-machine cache: a later process loads what an earlier one compiled, sums bit for bit the
same; a key that differs in anything the function depends on misses; a broken file is compiled over."""

import json
import warnings

import pytest
import torch

from divergence_probe import home
from divergence_probe.numerics import fused, reduction_cache
from divergence_probe.numerics.fused import diff_sums_of_groups

pytestmark = pytest.mark.engine  # compiles the tap reduction (torch.compile)

OPTIONS = {"deterministic": True}


def _groups(tokens: int, dtype=torch.bfloat16, device="cpu"):
    """Two groups of tap pairs as a compare stacks them ([taps, tokens, width]), the refs a rounding away."""
    g = torch.Generator().manual_seed(tokens)
    tests = [torch.randn(3, tokens, width, generator=g).to(dtype).to(device) for width in (64, 128)]
    refs = [(t.float() + 1e-2 * torch.randn(t.shape, generator=g).to(device)).to(dtype) for t in tests]
    return tests, refs


@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory):
    """A cache folder holding the pattern of `_groups`, written by a first process's compile."""
    folder = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(home.HOME_ENV, str(folder))
        tests, refs = _groups(40)
        saved = fused.saved_reductions(OPTIONS)
        assert saved(tests, refs) is not None
    assert len(list((folder / "reduction").iterdir())) == 1
    return folder


@pytest.fixture
def cache(saved_dir, monkeypatch):
    monkeypatch.setenv(home.HOME_ENV, str(saved_dir))
    return saved_dir / "reduction"


def _compiles(monkeypatch) -> list:
    """Record each compile a Saved asks for instead of compiling (it then serves the plain compiled path)."""
    calls = []
    monkeypatch.setattr(reduction_cache.Saved, "compile_and_save", lambda self, tests, refs, key: calls.append(key))
    return calls


def test_a_later_process_loads_the_saved_function_and_sums_bit_for_bit_as_compiled(cache, monkeypatch):
    compiles = _compiles(monkeypatch)
    saved = fused.saved_reductions(OPTIONS)
    plain = torch.compile(diff_sums_of_groups, dynamic=True, options=OPTIONS)
    for tokens in (40, 71, 7):  # the saved function takes every size of its pattern
        tests, refs = _groups(tokens)
        loaded = saved(tests, refs)
        assert loaded is not None and loaded.guard_check(tests, refs)
        assert torch.equal(loaded(tests, refs), plain(tests, refs))
    assert compiles == []


@pytest.mark.parametrize("change", ["torch version", "source", "dtype", "device", "threads"])
def test_a_key_that_differs_in_what_the_function_depends_on_misses_and_compiles(cache, monkeypatch, change):
    tests, refs = _groups(40)
    before = fused.saved_reductions(OPTIONS).key(tests, refs)
    if change == "torch version":
        monkeypatch.setattr(torch, "__version__", torch.__version__ + ".local")
    elif change == "source":
        monkeypatch.setattr(reduction_cache, "source_digest", lambda modules: "0" * 64)
    elif change == "dtype":
        tests, refs = _groups(40, torch.float16)
    elif change == "device":
        tests, refs = _groups(40, device="meta")
    else:
        monkeypatch.setattr(torch, "get_num_threads", lambda: 64)
    compiles = _compiles(monkeypatch)
    saved = fused.saved_reductions(OPTIONS)
    key = saved.key(tests, refs)
    assert key != before
    assert saved.load(key) is None
    assert saved(tests, refs) is None  # what the recorder gave: the plain compiled path serves it
    assert compiles == [key]


@pytest.mark.parametrize("damage", ["garbage", "truncated", "another key inside"])
def test_a_damaged_file_is_not_loaded(cache, monkeypatch, damage):
    tests, refs = _groups(40)
    saved = fused.saved_reductions(OPTIONS)
    key = saved.key(tests, refs)
    path = saved.path(key)
    data = path.read_bytes()
    header, payload = data.split(b"\n", 1)
    broken = {"garbage": b"\x00not a cache file", "truncated": data[:len(header) + 1 + len(payload) // 2],
              "another key inside": header.replace(b'"format": 1', b'"format": 0') + b"\n" + payload}[damage]
    try:
        path.write_bytes(broken)
        assert saved.load(key) is None
    finally:
        with open(path, "wb") as f:
            f.write(data)


def test_the_run_reduces_over_a_corrupt_file_without_a_word_and_writes_it_anew(tmp_path, monkeypatch):
    """End to end through fused_diff_sums: a corrupt file costs a compile, no error and no warning, the same sums."""
    monkeypatch.setenv(home.HOME_ENV, str(tmp_path))
    monkeypatch.delenv("DIVERGENCE_PROBE_EAGER", raising=False)
    tests, refs = _groups(40)
    saved = fused.saved_reductions(OPTIONS)
    key = saved.key(tests, refs)
    path = saved.path(key)
    path.parent.mkdir(parents=True)
    path.write_bytes(json.dumps(key, sort_keys=True).encode() + b"\n\x00corrupt")
    monkeypatch.setattr(fused, "_compiled", None)
    monkeypatch.setattr(fused, "_backend", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = fused.fused_diff_sums(tests, refs)
    assert fused.backend() == "torch.compile (inductor, deterministic)"
    assert torch.equal(got, torch.compile(diff_sums_of_groups, dynamic=True, options=OPTIONS)(tests, refs))
    assert saved.load(key) is not None  # compiled and saved over the corrupt file


def test_a_saved_function_torch_cannot_load_back_is_marked_and_never_precompiled_again(tmp_path, monkeypatch):
    """Bounded worst case: where this torch saves a function it cannot load (a device whose kernels do not come back),
    the first process marks the key and keeps its compiled function; later processes take the plain compiled path
    without precompiling."""
    monkeypatch.setenv(home.HOME_ENV, str(tmp_path))

    def refuse(f):
        raise RuntimeError("cannot load this function here")

    monkeypatch.setattr(torch.compiler, "load_compiled_function", refuse)
    tests, refs = _groups(40)
    first = fused.saved_reductions(OPTIONS)
    assert first(tests, refs) is not None  # this process keeps what it compiled
    key = first.key(tests, refs)
    assert first.unloadable(key).exists() and not first.path(key).exists()
    compiles = _compiles(monkeypatch)
    assert fused.saved_reductions(OPTIONS)(tests, refs) is None and compiles == []
