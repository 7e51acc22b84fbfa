"""models/ and the engines' layouts: the family registry, and each family's description and each engine's layout of
it against the real modules and checkpoints.

A family and its layouts are data that every stack reads instead of naming modules, so a wrong path there is a tap, a
patch or a sync check that silently reads the wrong thing; these tests hold each path to the module it names (transformers
on the meta device; vLLM through the session's one engine) and the checkpoint names to make-model's files.
"""

from __future__ import annotations

import json

import pytest
import torch

from divergence_probe.models.checkpoint import checkpoint_tensors, expected_tensors
from divergence_probe.errors import ModelError, ProbeError, StackError
from divergence_probe.engines.layouts import lookup
from divergence_probe.models import FAMILIES, dims, find, get_family
from divergence_probe.engines.vllm.seams import layer_seams
from divergence_probe.taps import LAYER_TAPS, ROUTE_RECORDS

ARCHS = sorted(FAMILIES)


@pytest.fixture(scope="module")
def checkpoints(qwen2_tiny, qwen3_tiny, qwen3_moe_tiny):
    return {"qwen2": qwen2_tiny, "qwen3": qwen3_tiny, "qwen3_moe": qwen3_moe_tiny}


def meta_model(folder):
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))


def test_unknown_model_type_is_one_line_listing_the_known():
    with pytest.raises(ModelError) as e:
        get_family("llama")
    message = str(e.value)
    assert "\n" not in message and "'llama'" in message
    assert all(name in message for name in FAMILIES)


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_a_family_without_a_layout_is_one_line_listing_the_known(engine):
    with pytest.raises(ProbeError) as e:
        lookup(engine, "llama")
    message = str(e.value)
    assert "\n" not in message and "'llama'" in message and engine in message
    assert all(name in message for name in FAMILIES)


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_every_engine_has_a_layout_of_every_family(engine):
    assert all(lookup(engine, arch) is lookup(engine, arch) for arch in ARCHS)


@pytest.mark.parametrize("arch", ARCHS)
def test_family_is_registered_under_its_model_type(arch):
    family = get_family(arch)
    assert family.model_type == arch
    assert family.architecture.endswith("ForCausalLM")


@pytest.mark.parametrize("arch", ARCHS)
def test_every_stack_reads_exactly_the_family_taps(arch):
    """Each layer tap is read at one seam on each stack, and the taps are a dataflow-ordered subset of the
    canonical ones (expected_taps and the pairing rely on both)."""
    family = get_family(arch)
    assert family.layer_taps == tuple(t for t in LAYER_TAPS if t in family.layer_taps)
    for layout in (lookup("hf", arch), lookup("vllm", arch)):
        read = [t for seam in layout.seams for t in seam.taps if t not in ROUTE_RECORDS]
        assert sorted(read) == sorted(family.layer_taps), layout
        assert all(seam.module == "" or seam.module in layout.layer for seam in layout.seams)
        assert all(role == "" or role in layout.layer for role in layout.regions.values())
        records = {t for seam in layout.seams for t in seam.taps if t in ROUTE_RECORDS}
        assert records == (set(ROUTE_RECORDS) if family.top_k_field else set())  # a MoE stack says where it routed
    assert set(family.layer_taps) <= set(family.widths)
    vllm = lookup("vllm", arch)
    assert all(f.module in vllm.layer for f in vllm.fused)
    assert not lookup("hf", arch).fused and lookup("hf", arch).experts is None  # transformers fuses nothing
    assert (vllm.experts is not None) == (family.top_k_field is not None)  # vLLM's MoE loader fills the experts
    assert family.layer_prefix == lookup("hf", arch).model["layers"]  # checkpoint names are transformers' own


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_paths_resolve_on_a_model_built_from_its_config(arch, checkpoints):
    family, hf = get_family(arch), lookup("hf", arch)
    model = meta_model(checkpoints[arch])
    assert model.config.model_type == arch
    for role, path in hf.model.items():
        assert find(model, path) is not None, (role, path)
    layers = find(model, hf.model["layers"])
    assert len(layers) == model.config.num_hidden_layers
    for layer in layers:
        for role, path in hf.layer.items():
            assert find(layer, path) is not None, (role, path)
    # the widths the compiled taps size buffers with are those of the modules
    layer, sizes = layers[0], dims(model.config)
    for name in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
        if name in family.layer_taps:  # a sparse MoE layer has no dense gate/up projections
            assert find(layer, hf.layer[name]).out_features == sizes[family.widths[name]], name
    if "swiglu" in family.layer_taps:
        assert find(layer, hf.layer["down_proj"]).in_features == sizes[family.widths["swiglu"]]
    if "router_logits" in family.layer_taps:  # the router's weight is [experts, hidden]
        assert find(layer, hf.layer["gate"]).weight.shape[0] == sizes[family.widths["router_logits"]]


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_tensor_names_are_make_models(arch, checkpoints):
    """The family's per-layer and model tensors are exactly what make-model writes and what transformers builds
    from the config (less the tied head), and each names config fields that exist."""
    family, folder = get_family(arch), checkpoints[arch]
    config = json.loads((folder / "config.json").read_text())
    tied = bool(config.get("tie_word_embeddings"))
    experts = config.get("num_experts") or config.get("num_local_experts") or 0
    names = family.tensor_names(config["num_hidden_layers"], tied, experts)
    assert names == set(checkpoint_tensors(folder))
    shapes, tied_names, cfg = expected_tensors(folder)
    shapes = family.checkpoint_shapes(shapes, names)  # transformers' fused experts as the checkpoint stores them
    assert names == set(shapes) - tied_names
    assert family.tensor_names(config["num_hidden_layers"], tied=False, num_experts=experts) == set(shapes)
    for name in names:  # head_dim: Qwen2 derives it from hidden_size / num_attention_heads
        assert all(hasattr(cfg, f) or f == "head_dim" for f in family.shape_fields(name)), name


def test_a_vllm_layer_without_a_named_module_is_a_one_line_error():
    family = get_family("qwen3")
    with pytest.raises(StackError) as e:
        layer_seams(torch.nn.Module(), family, {"q": 1, "kv": 1, "inter": 1, "hidden": 1})
    assert "\n" not in str(e.value) and lookup("vllm", "qwen3").layer["input_norm"] in str(e.value)


def test_vllm_paths_resolve_on_the_engines_model(vllm_probe):
    """The one in-process engine (tiny Qwen3): every vLLM path resolves, the packing is the model class's own
    packed_modules_mapping, and each fused split's sizes add up to the fused module's output."""
    model = vllm_probe.infer.model
    family = get_family(model.config.model_type)
    vllm = lookup("vllm", family.model_type)
    for role, path in vllm.model.items():
        assert find(model, path) is not None, (role, path)
    sizes = dims(model.config)
    for layer in find(model, vllm.model["layers"]):
        for role, path in vllm.layer.items():
            assert find(layer, path) is not None, (role, path)
        for fused in vllm.fused:
            module = find(layer, vllm.layer[fused.module])
            if fused.sizes:
                assert sum(sizes[d] for d in fused.sizes) == module.output_size_per_partition
        assert [s.names for s in layer_seams(layer, family, sizes)] == [s.taps for s in vllm.seams]
    mapping = {k: tuple(v) for k, v in type(model).packed_modules_mapping.items()}
    assert vllm.packed == mapping


@pytest.mark.parametrize("arch", ARCHS)
def test_the_trainers_tensors_as_saved_are_the_checkpoints_bit_for_bit(arch, checkpoints):
    """What rl pushes into the engine (Family.as_saved of transformers' state dict) is the checkpoint on disk: the same
    names and the same values, so any vLLM loader that reads the checkpoint reads the push (a fused expert parameter
    split in the wrong order, or under the wrong names, fails here)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    folder = checkpoints[arch]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    saved = {}
    for path in sorted(folder.glob("*.safetensors")):
        saved |= load_file(path)
    pushed = dict(get_family(arch).as_saved(model.state_dict().items()))
    tied = {n for n in pushed if n not in saved and model.config.tie_word_embeddings}
    assert set(pushed) - tied == set(saved)
    for name, tensor in saved.items():
        assert torch.equal(pushed[name], tensor), name


def test_a_stop_the_moment_the_build_folder_is_made_leaves_nothing(tmp_path, monkeypatch):
    """A signal lands at the first bytecode after a system call: a stop right after make_model's temporary folder is
    made must remove it too, as a stop during the build does."""
    from pathlib import Path

    from divergence_probe.models import modelzoo

    made = Path.mkdir

    def mkdir_then_stop(self, *args, **kwargs):
        made(self, *args, **kwargs)
        if ".tmp-" in self.name:
            raise KeyboardInterrupt

    monkeypatch.setattr(Path, "mkdir", mkdir_then_stop)
    with pytest.raises(KeyboardInterrupt):
        modelzoo.make_model(tmp_path / "model")
    assert list(tmp_path.iterdir()) == []
