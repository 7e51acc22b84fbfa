"""modelzoo's Qwen3-MoE checkpoints: the tiny one loads in transformers with the per-expert tensor layout of the
hub (which vLLM's loader reads), the qwen3-30b-a3b preset has the published shape, --layers cuts depth, and the
same seed gives the same bytes.

No vLLM here (an engine takes a minute to start): docs/design/moe.md has the tiny MoE in vLLM.
"""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from divergence_probe.cli import app
from divergence_probe.errors import ModelError
from divergence_probe.models.modelzoo import make_config, make_model

# Qwen/Qwen3-30B-A3B config.json, copied by hand independently of modelzoo.PRESETS.
PUBLISHED_30B_A3B = {
    "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
}


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("moe") / "tiny", arch="qwen3_moe", preset="tiny", seed=0)


@pytest.fixture(scope="module")
def hub_files(tmp_path_factory):
    """The files of a dense tiny checkpoint (test_modelzoo.py checks them): an MoE one has the same."""
    return {p.name for p in make_model(tmp_path_factory.mktemp("dense") / "tiny", arch="qwen3").iterdir()}


def expected_tensors(config) -> set[str]:
    """The hub's names for a Qwen3-MoE checkpoint, written out from the architecture rather than read from a
    model: one gate (router) and per-expert gate/up/down projections in every layer."""
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config["tie_word_embeddings"]:
        names.add("lm_head.weight")
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        names |= {p + n for n in ("input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate.weight")}
        names |= {f"{p}self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
        names |= {f"{p}mlp.experts.{e}.{n}.weight" for e in range(config["num_local_experts"])
                  for n in ("gate_proj", "up_proj", "down_proj")}
    return names


def test_tiny_moe_is_a_small_hub_checkpoint(tiny_moe, hub_files):
    assert {p.name for p in tiny_moe.iterdir()} == hub_files
    assert (tiny_moe / "model.safetensors").stat().st_size < 16 * 2**20
    config = json.loads((tiny_moe / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (config["num_local_experts"], config["num_experts_per_tok"], config["norm_topk_prob"]) == (32, 4, True)
    assert config["num_hidden_layers"] == 2 and config["mlp_only_layers"] == []


def test_tiny_moe_tensors_are_per_expert(tiny_moe):
    """transformers 5.x holds experts fused (experts.gate_up_proj [E, 2I, H]) but saves the hub's per-expert
    layout (save_pretrained's save_original_format), which is what vLLM's expert loader maps."""
    config = json.loads((tiny_moe / "config.json").read_text())
    weights = load_file(tiny_moe / "model.safetensors")
    assert set(weights) == expected_tensors(config)
    hidden, inter = config["hidden_size"], config["moe_intermediate_size"]
    assert weights["model.layers.0.mlp.gate.weight"].shape == (config["num_local_experts"], hidden)
    assert weights["model.layers.1.mlp.experts.31.gate_proj.weight"].shape == (inter, hidden)
    assert weights["model.layers.1.mlp.experts.31.up_proj.weight"].shape == (inter, hidden)
    assert weights["model.layers.1.mlp.experts.31.down_proj.weight"].shape == (hidden, inter)
    assert {w.dtype for w in weights.values()} == {torch.bfloat16}


def test_tiny_moe_loads_and_routes_in_transformers(tiny_moe):
    model = AutoModelForCausalLM.from_pretrained(tiny_moe)
    tok = AutoTokenizer.from_pretrained(tiny_moe)
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and model.dtype == torch.bfloat16
    experts = model.model.layers[0].mlp.experts
    # the per-expert tensors were merged back on load: expert 3's up_proj is the second half of its gate_up_proj
    saved = load_file(tiny_moe / "model.safetensors")
    assert torch.equal(experts.gate_up_proj[3, 64:], saved["model.layers.0.mlp.experts.3.up_proj.weight"])
    with torch.no_grad():
        out = model(**tok("def main():\n    return 0\n", return_tensors="pt"), output_router_logits=True)
    assert torch.isfinite(out.logits).all()
    assert len(out.router_logits) == 2 and out.router_logits[0].shape[-1] == 32
    # random routers must spread tokens over many experts, or the model would not exercise routing
    used = out.router_logits[0].float().topk(4, dim=-1).indices.unique()
    assert len(used) > 8


def test_same_seed_same_bytes(tiny_moe, tmp_path):
    again = make_model(tmp_path / "again", arch="qwen3_moe", preset="tiny", seed=0)
    assert {p.name for p in again.iterdir()} == {p.name for p in tiny_moe.iterdir()}
    for path in again.iterdir():
        assert path.read_bytes() == (tiny_moe / path.name).read_bytes(), path.name
    other = make_model(tmp_path / "other", arch="qwen3_moe", preset="tiny", seed=1)
    assert (other / "model.safetensors").read_bytes() != (tiny_moe / "model.safetensors").read_bytes()


def test_layers_cuts_depth_only(tmp_path):
    one = make_model(tmp_path / "one", arch="qwen3_moe", preset="tiny", num_layers=1)
    config = json.loads((one / "config.json").read_text())
    assert config["num_hidden_layers"] == 1
    assert set(load_file(one / "model.safetensors")) == expected_tensors(config)
    base, deep = make_config(arch="qwen3_moe").to_dict(), make_config(arch="qwen3_moe", num_layers=5).to_dict()
    changed = {k for k in base if base[k] != deep[k]}
    assert "num_hidden_layers" in changed and changed <= {"num_hidden_layers", "layer_types"}  # per-layer list


def test_30b_a3b_preset_has_the_published_shape():
    config = make_config(preset="qwen3-30b-a3b")  # arch left out: the preset's own
    assert config.model_type == "qwen3_moe"
    got = {k: getattr(config, k) for k in PUBLISHED_30B_A3B}
    assert got == PUBLISHED_30B_A3B
    assert config.rope_parameters["rope_theta"] == 1e6
    cut = make_config(preset="qwen3-30b-a3b", num_layers=4)
    assert cut.num_hidden_layers == 4 and cut.num_experts == 128


def test_cli_make_model_layers(tmp_path):
    result = CliRunner().invoke(app, ["make-model", str(tmp_path / "m"), "--arch", "qwen3_moe", "--layers", "1"])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "m" / "config.json").read_text())["num_hidden_layers"] == 1


@pytest.mark.parametrize("argv, fragment", [
    (["--arch", "qwen3_moe", "--layers", "0"], "--layers"),
    (["--arch", "qwen3", "--preset", "qwen3-30b-a3b"], "qwen3_moe"),
    (["--device", "tpu"], "choose cpu or cuda"),
    pytest.param(["--device", "cuda"], "sees no CUDA GPU",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")),
])
def test_cli_make_model_errors_are_one_line(tmp_path, monkeypatch, argv, fragment):
    monkeypatch.delenv("DP_RAISE_ERRORS", raising=False)
    result = CliRunner().invoke(app, ["make-model", str(tmp_path / "m"), *argv], terminal_width=400)
    assert result.exit_code == 2, result.output
    lines = result.output.strip("\n").splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], result.output
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("arch, preset, match", [
    ("qwen3", "qwen3-30b-a3b", "qwen3_moe"),  # the preset is an MoE: the dense arch is refused
    ("qwen3_moe", "qwen3-0.6b", "qwen3"),
    ("mixtral", "tiny", "qwen3_moe"),  # the error lists the valid archs
])
def test_arch_and_preset_must_agree(tmp_path, arch, preset, match):
    with pytest.raises(ModelError, match=match):
        make_model(tmp_path / "m", arch=arch, preset=preset)
    assert not any(tmp_path.iterdir())
