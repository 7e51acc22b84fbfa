"""RunSpec: one frozen tree, validated once, turned into CLI options and manifest data and back."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from divergence_probe.cli import app
from divergence_probe.errors import ProbeError
from divergence_probe.spec import (AblateSpec, AlignSpec, CaptureSpec, GenerateSpec, LoadSpec, PromptSpec, RunSpec,
                                   flat_fields, spec_from_flat)


def test_round_trip_through_json():
    spec = RunSpec(kind="ablate", load=LoadSpec(model="m", dtype="float32", engine_args='{"max_num_seqs": 4}'),
                   prompts=PromptSpec(prompts="p.txt", num_prompts=3), capture=CaptureSpec(taps="logits"),
                   generate=GenerateSpec(mode="generate", temperature=0.5), align=AlignSpec(side="train"),
                   ablate=AblateSpec(regions="rope,rmsnorm", bootstrap=10))
    again = RunSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert again == spec
    assert again.load.engine_args == {"max_num_seqs": 4}
    assert again.ablate.regions == ("rope", "rmsnorm")


def test_generate_seed_is_the_run_seed():
    assert RunSpec(load=LoadSpec(seed=7)).generate.seed == 7


@pytest.mark.parametrize("kind", ["compare", "ablate"])
def test_flat_names_are_unique_and_every_one_is_a_flag(kind):
    names = [name for _, _, name in flat_fields(kind)]
    assert len(names) == len(set(names))
    result = CliRunner().invoke(app, [kind, "--help"], terminal_width=400)
    assert result.exit_code == 0
    for name in names:
        assert "--" + name.replace("_", "-") in result.output


@pytest.mark.parametrize("flat, message", [
    ({"dtype": "int8"}, "--dtype"), ({"side": "left"}, "--side"), ({"mode": "decode"}, "--mode"),
    ({"taps": "nope"}, "unknown tap"), ({"engine_args": "[1]"}, "--engine-args"), ({"engine_args": "{"}, "JSON"),
    ({"engine_args": '{"a": ' + "[" * 5000 + "]" * 5000 + "}"}, "--engine-args is not JSON the tool reads"),
    ({"align": "rope,bogus"}, "unknown region"), ({"top_p": 0.0}, "--top-p"), ({"threshold": -1.0}, "--threshold"),
    ({"engine": "fast"}, "--engine"), ({"train_sdpa": "x"}, "--train-sdpa"), ({"num_prompts": 0}, "--num-prompts"),
    ({"nonsense": 1}, "unknown option"), ({"seed": -1}, "--seed"),
    ({"train_sdpa": "math", "train_attn": "eager"}, "needs --train-attn sdpa"),
    ({"infer": "hf", "engine": "compiled"}, "configure vLLM"),
    ({"engine": "compiled", "taps": "resid_out,logits"}, "cannot be captured under --engine compiled"),
    ({"infer": "hf", "engine_noise": True}, "--engine-noise"),
    ({"temperature": 0.5}, "only applies with --mode generate"),
])
def test_bad_values_fail_when_the_spec_is_built(flat, message):
    with pytest.raises(ProbeError, match=message):
        spec_from_flat("compare", **flat)


def test_a_reference_no_finer_than_the_stacks_dtype_is_one_line_naming_float64(tmp_path, monkeypatch):
    """Against a reference at their own precision both stacks' error is nothing but rounding order, its floor 0: the
    verdict's ratio of one side's error to the other's would read as a finding."""
    monkeypatch.chdir(tmp_path)
    for kind in ("compare", "ablate"):
        result = CliRunner().invoke(app, [kind, "--device", "cpu", "-n", "2", "--dtype", "float32", "--reference",
                                          "float32"])
        assert result.exit_code == 2, result.output
        assert result.output.splitlines() == ["error: --reference float32 is no finer than --dtype float32, so both "
                                              "stacks would be measured against their own precision; use "
                                              "--reference float64"], result.output
    assert not list(tmp_path.iterdir())
    for dtype in ("bfloat16", "float16"):
        assert spec_from_flat("compare", dtype=dtype, reference="float32").capture.reference == "float32"
    assert spec_from_flat("compare", dtype="float32", reference="float64").capture.reference == "float64"


def test_ablate_rejects_align_and_empty_regions():
    with pytest.raises(ProbeError, match="unknown option"):
        spec_from_flat("ablate", align="rope")
    with pytest.raises(ProbeError, match="--regions is empty"):
        spec_from_flat("ablate", regions="")
    with pytest.raises(ProbeError, match="--ci-level"):
        spec_from_flat("ablate", ci_level=1.5)


def test_compiled_engine_takes_the_taps_that_cross_its_graph_and_alignment_on_every_side():
    spec_from_flat("compare", engine="compiled", taps="logits,final_norm", align="rope", side="train")
    spec_from_flat("ablate", engine="compiled", side="train")
    spec_from_flat("ablate", engine="compiled")  # side both: one engine built per combination
    spec_from_flat("compare", engine="compiled", align="rope", side="infer", engine_noise=True)


def test_a_manifest_spec_from_another_version_is_refused():
    data = RunSpec().to_dict()
    data["load"]["warp_drive"] = True
    with pytest.raises(ProbeError, match="warp_drive"):
        RunSpec.from_dict(data)
    for broken in ([1, 2], {"capture": {"taps": 5}}):
        with pytest.raises(ProbeError, match="does not fit"):
            RunSpec.from_dict(broken)


def test_a_manifest_written_before_a_later_field_reruns_as_it_ran():
    """A spec recorded before --train-precision existed (tests/fixtures/recorded_specs.jsonl holds such specs) is read
    as bf16, what every run did then; a field that is not a later addition stays required."""
    from divergence_probe.spec import LATER_FIELDS, RunSpec

    recorded = RunSpec().to_dict()
    del recorded["load"]["train_precision"]
    assert RunSpec.from_dict(recorded).load.train_precision == LATER_FIELDS[("load", "train_precision")] == "bf16"
    del recorded["load"]["seed"]
    with pytest.raises(ProbeError, match="spec.load lacks the field.s. seed"):
        RunSpec.from_dict(recorded)


def test_every_recorded_run_spec_still_reads():
    """Specs recorded by earlier versions (tests/fixtures/recorded_specs.jsonl: every distinct one of the GPU runs
    the results pages rest on) must still read (rerun's first step), their missing fields being LATER_FIELDS only."""
    from pathlib import Path

    from divergence_probe.spec import RunSpec

    recorded = Path(__file__).resolve().parents[1] / "fixtures" / "recorded_specs.jsonl"
    specs = [json.loads(line) for line in recorded.read_text().splitlines()]
    assert len(specs) >= 40
    for spec in specs:
        RunSpec.from_dict(spec)
