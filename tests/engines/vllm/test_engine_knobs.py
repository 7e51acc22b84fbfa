"""Deployment knobs: the engine's own checks of its FP8 args, what its taps mean under them, and `ablate --factor`
(every subset of regions and factors, a Shapley row per factor; an impossible knob is one line before loading)."""

from __future__ import annotations

from importlib.util import find_spec

import pandas as pd
import pytest
from typer.testing import CliRunner

from divergence_probe.cli import app
from divergence_probe.engines import parse_factors
from divergence_probe.engines.vllm.knobs import check_knobs, tap_meanings
from divergence_probe.errors import ProbeError
from divergence_probe.numerics.shapley import ALL_REGIONS, CHANGE
from divergence_probe.spec import AblateSpec, LoadSpec, RunSpec
from test_compare_cli import assert_nothing_written, assert_one_line_error


def test_fp8_on_a_cpu_is_refused_by_the_engine_before_loading():
    for args in ({"kv_cache_dtype": "fp8"}, {"quantization": "fp8"}):
        with pytest.raises(ProbeError, match="runs on cuda only"):
            check_knobs(args, "cpu")
    with pytest.raises(ProbeError, match="not a setting the tool measures"):
        check_knobs({"quantization": "awq"}, "cuda")
    check_knobs({"kv_cache_dtype": "auto", "max_num_seqs": 8}, "cpu")  # nothing quantized: nothing to refuse


@pytest.mark.skipif(find_spec("compressed_tensors") is not None, reason="compressed-tensors is installed here")
def test_fp8_weights_without_compressed_tensors_say_how_to_install_it():
    with pytest.raises(ProbeError, match="pip install compressed-tensors"):
        check_knobs({"quantization": "fp8"}, "cuda")


def test_taps_under_a_quantized_engine_say_what_they_are():
    assert tap_meanings({}) == {}
    kv = tap_meanings({"kv_cache_dtype": "fp8"})
    assert "fp8 KV cache" in kv["attn_core"] and "before" in kv["k_rope"]
    assert "fp8 GEMM" in tap_meanings({"quantization": "fp8"})["q_proj"]


def test_compare_with_an_fp8_cache_on_a_cpu_is_one_line_and_writes_nothing(tmp_path):
    out_dir = tmp_path / "run"
    result = CliRunner().invoke(app, ["compare", "--device", "cpu", "--engine-args", '{"kv_cache_dtype": "fp8"}',
                                      "--out", str(out_dir)])
    assert_one_line_error(result, "kv_cache_dtype=fp8 runs on cuda only")
    assert_nothing_written(out_dir)


@pytest.mark.parametrize("factor, message", [
    ("engine:quantization=fp8", "--factor engine:quantization=fp8: --engine-args quantization=fp8 runs on cuda only"),
    ("train:kernels=liger", "--factor train:kernels=liger: --train-kernels liger runs on cuda only"),
    ("engine:kv_cache_dtype=int4", "engine:kv_cache_dtype takes fp8, fp8_e4m3, fp8_e5m2"),
    ("rmsnorm", "a region goes in --regions"),
    ("train:kernels=torch", "is what the run already runs"),
])
def test_an_impossible_factor_is_one_line_and_writes_nothing(tmp_path, factor, message):
    out_dir = tmp_path / "ab"
    result = CliRunner().invoke(app, ["ablate", "--device", "cpu", "--regions", "lm_head", "--factor", factor,
                                      "--out", str(out_dir)])
    assert_one_line_error(result, message)
    assert_nothing_written(out_dir)


def test_factors_are_repeated_or_comma_lists_and_one_value_per_knob():
    assert parse_factors(["train:kernels=vllm,engine:enforce_eager=false", "train:kernels=vllm"]) == (
        "train:kernels=vllm", "engine:enforce_eager=false")
    with pytest.raises(ProbeError, match="set the same knob"):
        parse_factors(["train:kernels=vllm", "train:kernels=liger"])


def test_every_combination_is_checked_as_its_own_run_before_loading():
    load = LoadSpec(device="cpu")
    with pytest.raises(ProbeError, match="the combination rmsnorm\\+train:kernels=vllm cannot run: region rmsnorm"):
        RunSpec(kind="ablate", load=load, ablate=AblateSpec(regions=("rmsnorm",), factors=("train:kernels=vllm",)))
    with pytest.raises(ProbeError, match="combination train:precision=amp cannot run: --train-precision amp"):
        RunSpec(kind="ablate", load=load, ablate=AblateSpec(regions=("lm_head",), factors=("train:precision=amp",)))
    spec = RunSpec(kind="ablate", load=load, ablate=AblateSpec(regions=("lm_head",), factors=("train:kernels=vllm",)))
    both = spec.combination(frozenset({"lm_head", "train:kernels=vllm"}))
    assert both.load.train_kernels == "vllm" and both.align.regions == ("lm_head",) and both.kind == "compare"
    assert spec.combination(frozenset()).load == load
    eager = RunSpec(kind="ablate", load=load, ablate=AblateSpec(regions=("lm_head",),
                                                                factors=("engine:enforce_eager=false",)))
    assert eager.combination(frozenset({"engine:enforce_eager=false"})).load.engine == "compiled"


def test_a_knob_added_to_the_engines_table_is_an_ablate_factor_with_no_other_edit(monkeypatch):
    """The engine declares its knobs whole: one entry of its KNOBS is a factor, checked by the engine, changing the
    engine args the factor's combinations load."""
    from divergence_probe.engines.vllm import knobs

    monkeypatch.setitem(knobs.KNOBS, "block_size", knobs.EngineKnob("block_size", ("16", "32"), "the KV block size",
                                                                    default="16"))
    load = LoadSpec(device="cpu")
    spec = RunSpec(kind="ablate", load=load, ablate=AblateSpec(regions=("lm_head",), factors=("engine:block_size=32",)))
    assert spec.combination(frozenset({"engine:block_size=32"})).load.engine_args == {"block_size": "32"}
    with pytest.raises(ProbeError, match="engine:block_size takes 32$"):  # the engine's own setting is no factor
        parse_factors(["engine:block_size=16"])


def test_a_quantizing_knob_added_to_the_engines_table_is_checked_and_says_what_its_taps_are(monkeypatch, tmp_path):
    """An FP8 engine configuration is one entry: its devices are checked before loading, as a compare's engine arg and
    as a factor, and its tap meanings reach the manifest's (Capabilities.tap_meanings)."""
    from divergence_probe.engines.needs import Needs
    from divergence_probe.engines.vllm import knobs

    monkeypatch.setitem(knobs.KNOBS, "moe_dtype", knobs.EngineKnob(
        "moe_dtype", ("auto", "fp8"), "the experts' dtype", Needs(devices=("cuda",)), default="auto",
        meanings=lambda value: {"moe_out": f"the output of {value} experts"}))
    assert tap_meanings({"moe_dtype": "fp8", "kv_cache_dtype": "auto"}) == {"moe_out": "the output of fp8 experts"}
    with pytest.raises(ProbeError, match="moe_dtype='int4' is not a setting the tool measures"):
        check_knobs({"moe_dtype": "int4"}, "cuda")
    out_dir = tmp_path / "ab"
    result = CliRunner().invoke(app, ["ablate", "--device", "cpu", "--regions", "lm_head", "--factor",
                                      "engine:moe_dtype=fp8", "--out", str(out_dir)])
    assert_one_line_error(result, "--factor engine:moe_dtype=fp8: --engine-args moe_dtype=fp8 runs on cuda only")
    assert_nothing_written(out_dir)


@pytest.mark.engine
def test_a_region_and_a_trainer_kernel_factor_make_four_combinations_and_a_row_each(vllm_probe, prompts_file):
    run = vllm_probe.ablate(prompts=prompts_file, regions="lm_head", factor=["train:kernels=vllm"], bootstrap=50)
    ablation = run.ablation_table
    assert list(ablation.combo) == ["none", "lm_head", "train:kernels=vllm", "lm_head+train:kernels=vllm"]
    assert list(ablation.columns[:3]) == ["combo", "lm_head", "train:kernels=vllm"]
    attribution = run.attribution_table
    assert list(attribution.region) == ["lm_head", "train:kernels=vllm", ALL_REGIONS]
    assert attribution[CHANGE].notna().all()
    # three prompts are fewer than an interval needs (shapley.MIN_PROMPTS): none is given, no effect is claimed
    assert attribution["share_ci_low"].isna().all() and (attribution["effect"] == "no_interval").all()
    layers = run.layers_table.set_index(["combo", "tap", "layer"])
    assert layers.loc[("train:kernels=vllm", "q_rope", 0), "frac_equal"] == 1.0  # the engine's RoPE in the trainer
    assert layers.loc[("none", "q_rope", 0), "frac_equal"] < 1.0
    assert vllm_probe.train.kernels == "torch"  # the kernel set is the combination's only
    assert run.manifest["ablate"]["factors"]["train:kernels=vllm"]["train_kernels"] == "vllm"
    assert isinstance(run.files()["attribution.csv"], pd.DataFrame)
