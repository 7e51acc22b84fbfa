"""Stacks declare what they can do (engines/protocol.py Capabilities) and the runs ask: every registered stack class
declares before anything loads, a feature a stack refuses is refused with the reason it declared, and the package
does not go back to probing members with hasattr."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from divergence_probe.cli import app
from divergence_probe.engines import (SHARDED, SIDE_LISTS, STACKS, WORKERS, capabilities_of, register_stack,
                                      stack_class)
from divergence_probe.errors import StackError
from divergence_probe.engines.protocol import (PATCH_AFTER_LOAD, PATCH_AT_BUILD, PATCH_NEVER, PATCH_ONCE_LOADED,
                                               Capabilities, Grafter, RouteRecorder, RouteReplayer, StackSettings)
from divergence_probe.errors import ProbeError, StackError
from divergence_probe.taps import ALL_TAPS, ROUTE_RECORDS
from toy_stack import ToyStack

PACKAGE = Path(__file__).resolve().parents[2] / "divergence_probe"
MAX_HASATTR = 4  # library version checks (torch, vLLM); never a stack's members
ROLES = {"grafts": Grafter, "replays_routes": RouteReplayer, "records_routes": RouteRecorder}


class RefusingToyStack(ToyStack):
    name = "toy-refusing"
    REASON = "--mode generate is not built for this toy: it scores prompts only; use --mode prefill"

    @classmethod
    def declare(cls, engine: str = "eager", ranks: int = 1) -> Capabilities:
        return Capabilities(taps={name: "captured" for name in ALL_TAPS}, refused={"--mode generate": cls.REASON})


class BlindToyStack(ToyStack):
    name = "toy-blind"
    REASON = "not captured by this toy: its layers have no gate"

    @classmethod
    def declare(cls, engine: str = "eager", ranks: int = 1) -> Capabilities:
        return Capabilities(taps={name: cls.REASON if name == "swiglu" else "captured" for name in ALL_TAPS})


class BuiltToyStack(ToyStack):
    name = "toy-built"
    REASON = "this toy takes its regions when it is built; build another"

    @classmethod
    def declare(cls, engine: str = "eager", ranks: int = 1) -> Capabilities:
        return Capabilities(taps={name: "captured" for name in ALL_TAPS}, patch=PATCH_AT_BUILD,
                            refused={PATCH_ONCE_LOADED: cls.REASON})


class MeaningToyStack(ToyStack):
    name = "toy-meaning"
    fused = True  # a second toy that differs from the trainer toy, as a quantized engine does
    MEANINGS = {"resid_out": "the residual after a toy's FP8 GEMM", "q_proj": "a tap this run does not capture"}

    def capabilities(self) -> Capabilities:
        return replace(self.declare(), tap_meanings=self.MEANINGS)


@pytest.fixture
def refusing_toys(toy):
    removers = [register_stack(cls.name, f"{__name__}:{cls.__name__}")
                for cls in (RefusingToyStack, BlindToyStack, BuiltToyStack, MeaningToyStack)]
    yield
    for remove in removers:
        remove()


@pytest.mark.parametrize("name", sorted(STACKS))
@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("engine", ["eager", "compiled"])
def test_every_registered_stack_class_declares_its_capabilities(name, ranks, engine):
    """Before loading, from the class alone: which taps and why not, what it refuses, when a patch takes effect; and
    the roles it declares are the ones its class plays."""
    cls = stack_class(name, ranks)
    assert (cls.__module__ + ":" + cls.__name__) == (SHARDED[name] if ranks > 1 and name in SHARDED else STACKS[name])
    declared = capabilities_of(name, engine=engine, ranks=ranks)
    assert isinstance(declared, Capabilities) and declared == cls.declare(engine, ranks)
    assert set(declared.taps) <= set(ALL_TAPS) | set(ROUTE_RECORDS)
    assert declared.logits == (name != "recorded")  # recorded rollouts hold logprobs only
    assert all(why == "captured" or why.startswith("not captured") for why in declared.taps.values())
    assert declared.patch in (PATCH_AFTER_LOAD, PATCH_AT_BUILD, PATCH_NEVER)
    for role, protocol in ROLES.items():
        assert not getattr(declared, role) or issubclass(cls, protocol), (name, role)


def _registered_classes() -> list[str]:
    return sorted({*STACKS.values(), *SHARDED.values(), *WORKERS.values()})


@pytest.mark.parametrize("side", sorted(SIDE_LISTS))
def test_the_registry_lists_a_stack_only_on_a_side_its_class_declares(side):
    """The registry lists its stacks' sides so that --help imports none of them; the class declares them
    (StackClass.sides, what a stack an installed package adds is asked), and the two agree."""
    assert [name for name in SIDE_LISTS[side] if side not in stack_class(name).sides] == []


@pytest.mark.parametrize("entry", _registered_classes())
def test_every_registered_class_owns_its_pre_load_policy_as_the_protocol_declares_it(entry):
    """Every class the registry hands out (in process, sharded, in a worker) has each seat of StackClass, with the
    protocol's signature: what a caller outside engines/ asks before anything loads."""
    import inspect
    from importlib import import_module

    from divergence_probe.engines.protocol import StackClass

    module, name = entry.split(":")
    cls = getattr(import_module(module), name)
    for seat, declared in vars(StackClass).items():
        if seat.startswith("_"):
            continue
        member = inspect.getattr_static(cls, seat)
        if isinstance(declared, classmethod):
            assert isinstance(member, classmethod), (entry, seat)
            ours, theirs = ([(p.name, p.kind, p.annotation) for p in inspect.signature(getattr(c, seat)).parameters
                             .values()] for c in (cls, StackClass))  # defaults may differ: a sharded class's ranks
            assert ours == theirs, (entry, seat)
    for seat in inspect.get_annotations(StackClass):  # its declared attributes: name, title, workers, ...
        assert seat in dir(cls), (entry, seat)
    assert cls.workers == (cls.name in WORKERS), entry  # a worker variant is registered where it declares one


def test_the_engines_declarations_say_what_the_spec_refuses():
    """A compiled engine refuses the taps Inductor never writes, --graft and a patch once built; a sharded engine or
    trainer refuses what needs its modules in this process, with the ranks in the line."""
    from divergence_probe.engines.vllm.worker import WorkerStack

    compiled = capabilities_of("vllm", engine="compiled")
    assert compiled.not_captured().keys() == {"resid_mid", "resid_out", "q_norm", "k_norm"}
    assert compiled.patch == PATCH_AT_BUILD and "--graft" in compiled.refused
    assert capabilities_of("vllm").patch == PATCH_AFTER_LOAD and not capabilities_of("vllm").refused
    sharded = capabilities_of("vllm", ranks=3)
    assert sharded.first_refused(["--align", "--mode generate"]).startswith(
        "--mode generate cannot run at tensor_parallel_size 3: ")
    assert "--train-tp 4 shards" in capabilities_of("hf", ranks=4).refused["--depth"]
    assert WorkerStack.declare("compiled").patch == PATCH_AT_BUILD
    assert capabilities_of("hf").grafts and not capabilities_of("vllm").grafts


def test_a_declaration_that_patches_elsewhere_says_why():
    with pytest.raises(ValueError, match="says why"):
        Capabilities(taps={}, patch=PATCH_NEVER)
    with pytest.raises(ValueError, match="not one of"):
        Capabilities(taps={}, patch="sometimes")
    declared = Capabilities(taps={"embed": "captured"})
    with pytest.raises(TypeError):
        declared.taps["embed"] = "not captured"  # a declaration is shared: read-only


def test_a_feature_the_stack_refuses_is_refused_with_its_reason_before_loading(refusing_toys, qwen3_tiny,
                                                                               prompts_file, tmp_path, monkeypatch):
    from divergence_probe.runs import loading

    monkeypatch.setattr(loading, "stack_for", lambda *a: pytest.fail("a stack loaded before the refusal"))
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["compare", "--model", str(qwen3_tiny), "--infer", "toy-refusing", "--train",
                                      "toy", "--prompts", str(prompts_file), "--mode", "generate", "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert RefusingToyStack.REASON in result.output and not out.exists()


@pytest.mark.engine  # the compare's metrics compile
def test_what_an_engines_taps_mean_is_asked_of_the_engine_and_recorded(refusing_toys, qwen3_tiny, prompts_file,
                                                                         tmp_path):
    """The manifest says what the inference stack's taps are where they differ from the trainer's (a quantized
    engine's): the run asks the loaded stack's capabilities, for the taps it captured, whatever the engine."""
    assert not capabilities_of("vllm").tap_meanings and not capabilities_of("hf").tap_meanings  # nothing quantized
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["compare", "--model", str(qwen3_tiny), "--infer", "toy-meaning", "--train", "toy",
                                      "--prompts", str(prompts_file), "--taps", "resid_out", "--out", str(out)])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["compare"]["tap_meanings"] == {"resid_out": MeaningToyStack.MEANINGS["resid_out"]}


def test_a_tap_the_stack_cannot_capture_is_refused_with_its_reason(refusing_toys):
    from divergence_probe.spec import CaptureSpec, LoadSpec, RunSpec

    with pytest.raises(ProbeError) as e:
        RunSpec(load=LoadSpec(infer="toy-blind", train="toy"), capture=CaptureSpec(taps="swiglu,attn_out"))
    assert str(e.value) == ("taps swiglu cannot be captured by this toy: its layers have no gate; or drop them from "
                            "--taps")
    RunSpec(load=LoadSpec(infer="toy-blind", train="toy"), capture=CaptureSpec(taps="all"))  # all: what it can


def test_a_stack_patched_at_build_refuses_a_patch_once_loaded(refusing_toys, qwen3_tiny):
    from divergence_probe.engines.patching import aligned
    from divergence_probe.runs.engine_align import needs_engine_build

    stack = BuiltToyStack()
    stack.load(StackSettings(model_path=str(qwen3_tiny), dtype=torch.bfloat16, device="cpu"))
    with pytest.raises(StackError, match=re.escape(BuiltToyStack.REASON)):
        with aligned([stack], ["toy-align"]):
            pass
    assert needs_engine_build(SimpleNamespace(infer=stack), ["toy-align"], "both")
    assert not needs_engine_build(SimpleNamespace(infer=stack), ["toy-align"], "train")
    plain = ToyStack()
    plain.load(StackSettings(model_path=str(qwen3_tiny), dtype=torch.bfloat16, device="cpu"))
    with aligned([plain], ["toy-align"]):
        assert plain.model.layers[0].fused


def test_grafting_needs_a_trainer_that_declares_it(toy):
    from divergence_probe.runs.graft import check_graftable

    with pytest.raises(ProbeError, match="toy cannot: use --train hf"):
        check_graftable(ToyStack())


def test_hasattr_stays_rare():
    """Capabilities are declared, never probed: hasattr is left for library version checks, and may not spread."""
    counts = {}
    for path in PACKAGE.rglob("*.py"):
        name = path.relative_to(PACKAGE).as_posix()
        counts[name] = path.read_text().count("hasattr(")
    assert "engines/protocol.py" in counts  # the package itself was read
    assert sum(counts.values()) <= MAX_HASATTR, {name: n for name, n in counts.items() if n}


def test_recorded_rollouts_serve_logprobs_only_and_compare_refuses_them_its_token_kl():
    """score's inference side is a file: the recorded stack declares no logits and no taps, serves each sequence's
    recorded response logprobs (NaN where the run sampled nothing), and compare's run loop, which score runs too, asks
    its capabilities before it would take a KL over logits it does not have."""
    import math

    from divergence_probe.engines.recorded.stack import RecordedStack
    from divergence_probe.prompts import Prompt
    from divergence_probe.runs.compare import SequenceSource, score_both

    declared = capabilities_of("recorded")
    assert not declared.logits and not any(why == "captured" for why in declared.taps.values())
    assert declared.first_refused(["--graft"]) and declared.first_refused(["ablate"])
    stack = RecordedStack({0: [-0.5, -0.25]})
    [scores] = stack.score([Prompt(0, "row 0", "", (1, 2, 3, 4))], frozenset(), lambda *_: None)
    assert scores.logits is None and math.isnan(scores.logprobs[0]) and scores.logprobs[1:].tolist() == [-0.5, -0.25]

    class Sides:
        infer, train, tokenizer = stack, None, None

    with pytest.raises(StackError, match="hands over no logits"):
        score_both(Sides(), [], SequenceSource(), frozenset(), frozenset(), None, lambda scores: None)
