"""numerics/reference.py without a model: growth exponents on errors whose growth is known, and the verdict's
reading of its interval."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from divergence_probe.errors import ProbeError
from divergence_probe.numerics.reference import (BOTH_EXACT, GROWTH_FLAT, GROWTH_LINEAR, GROWTH_SQRT, NOT_DETECTED,
                                                 TOO_FEW, TRAIN_FURTHER, growth_exponent, growth_kind,
                                                 summary_columns)
from divergence_probe.spec import CaptureSpec


def _accumulated(bias: float, steps: int = 32, trials: int = 4000) -> np.ndarray:
    """RMS over trials of a sum of `n` errors, each unit Gaussian noise plus `bias`, for n = 1..steps."""
    rng = np.random.default_rng(0)
    walks = np.cumsum(rng.standard_normal((trials, steps)) + bias, axis=1)
    return np.sqrt((walks ** 2).mean(axis=0))


def test_rounding_noise_grows_like_sqrt_n_and_a_bias_like_n():
    n = np.arange(1, 33)
    noise, biased = growth_exponent(n, _accumulated(0.0)), growth_exponent(n, _accumulated(5.0))
    assert noise == pytest.approx(0.5, abs=0.05) and growth_kind(noise) == GROWTH_SQRT
    assert biased == pytest.approx(1.0, abs=0.05) and growth_kind(biased) == GROWTH_LINEAR
    assert growth_kind(growth_exponent(n, np.full(32, 3e-3))) == GROWTH_FLAT


def test_no_exponent_from_fewer_than_three_nonzero_points():
    assert np.isnan(growth_exponent([1, 2, 3], [0.0, 1.0, 2.0])) and growth_kind(float("nan")) == ""


def _tokens(prompts: int, infer: float, train, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []
    for p in range(prompts):
        for pos in range(1, 9):
            t = train(rng) if callable(train) else train
            rows.append({"prompt_id": p, "position": pos, "ref_err_infer": infer, "ref_err_train": t,
                         "ref_floor": 1e-4})
    return pd.DataFrame(rows)


def _verdict(tokens: pd.DataFrame) -> dict:
    return summary_columns("float64", pd.DataFrame(columns=["prompt_id", "layer", "tap"]), tokens, "logprobs", 0)


def test_the_verdict_follows_the_interval_over_prompts():
    further = _verdict(_tokens(20, 1e-3, 3e-3))
    assert further["ref_verdict"] == TRAIN_FURTHER and further["ref_ratio"] == pytest.approx(3)
    assert not further["ref_within_k"]  # 3e-3 > 2 x 1e-3 + 1e-4
    # the trainer's error scattered evenly around the engine's: an interval that holds 1
    spread = _verdict(_tokens(20, 1e-3, lambda rng: rng.choice([0.5e-3, 1.5e-3])))
    assert spread["ref_ratio_ci_low"] < 1 < spread["ref_ratio_ci_high"] and spread["ref_verdict"] == NOT_DETECTED
    assert _verdict(_tokens(19, 1e-3, 3e-3))["ref_verdict"] == TOO_FEW
    assert _verdict(_tokens(20, 0.0, 0.0))["ref_verdict"] == BOTH_EXACT


def test_reference_takes_float64_or_float32_only():
    assert CaptureSpec(reference="float32").reference == "float32"
    with pytest.raises(ProbeError, match="--reference"):
        CaptureSpec(reference="float16")


QWEN25_7B = {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
             "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False}


def test_a_7b_reference_in_float64_is_refused_for_float32_where_that_fits_and_outright_where_neither_does():
    from divergence_probe.errors import DeviceMemoryError
    from divergence_probe.models import get_family
    from divergence_probe.models.size import ModelSize
    from divergence_probe.numerics.reference import reference_terms
    from divergence_probe.runs.reference import check_fits, reference_bytes

    size = ModelSize.of(QWEN25_7B, get_family("qwen2"))
    weights64 = size.parameters * 8
    assert 56e9 < weights64 < 64e9  # an FP64 copy of a 7B model: its weights alone
    terms64, terms32 = reference_terms(size, "float64", 512, 512), reference_terms(size, "float32", 512, 512)
    assert all(terms64[t] == 2 * terms32[t] for t in ("reference_weights", "reference_batch"))  # what it holds
    free = (reference_bytes(size, "float64", 512, 512) + reference_bytes(size, "float32", 512, 512)) // 2  # f32 fits
    with pytest.raises(DeviceMemoryError, match="--reference float32 needs about .* and fits: use it"):
        check_fits(size, "float64", 512, 512, free, "cuda", "beside the two stacks as planned")
    with pytest.raises(DeviceMemoryError, match=r"\(float32: about .*\); drop --reference"):
        check_fits(size, "float64", 512, 512, weights64 // 4, "cuda", "beside the two stacks as planned")
    check_fits(size, "float32", 512, 512, free, "cuda", "beside the two stacks as planned")  # fits: no error


def test_an_ablation_says_whether_each_combination_moved_the_trainer_toward_exact_from_its_interval():
    from divergence_probe.numerics.reference import combination_lines

    table = pd.DataFrame({"combo": ["none", "rope", "swiglu", "rmsnorm"], "reference": "float64",
                          "mean_abs_dlogp": [3e-3] * 4, "ref_logprob_err_train": [4e-3, 3e-3, 5e-3, 4e-3],
                          "ref_logprob_err_infer": [2e-3] * 4})
    rng = np.random.default_rng(1)
    base = rng.uniform(3e-3, 5e-3, 20)  # per prompt; rope lowers every prompt's, swiglu raises every one's
    parts = {"none": base, "rope": base - 1e-3, "swiglu": base + 1e-3,
             "rmsnorm": base + rng.choice([-1e-3, 1e-3], 20)}  # up on some prompts, down on others
    tokens = pd.concat([pd.DataFrame({"combo": combo, "prompt_id": np.arange(20), "ref_err_train": values})
                        for combo, values in parts.items()], ignore_index=True)
    lines = combination_lines(table, tokens, "none", 0)
    assert lines[0].startswith("Against float64") and len(lines) == 5
    assert "the trainer moved toward exact" in lines[2] and "the trainer moved away from exact" in lines[3]
    assert "no detectable move" in lines[4]
    assert "no direction claimed" in combination_lines(table, None, "none", 0)[2]
    assert "no interval: fewer than 20 prompts" in combination_lines(table, tokens[tokens["prompt_id"] < 19], "none", 0)[2]
    assert combination_lines(table.drop(columns="reference"), tokens, "none", 0) == []
