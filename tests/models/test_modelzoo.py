"""modelzoo: seeded random Qwen checkpoints that transformers loads, built atomically and reproducibly, and the
trained default model that ships in the package.

No vLLM here: starting an engine takes a minute, and the vLLM stack's tests do it.
"""

import unicodedata
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from divergence_probe.models import modelzoo
from divergence_probe.errors import ModelError, OutputError
from divergence_probe.models.modelzoo import ARCHS, PRESETS, make_config, make_model
from divergence_probe.rundir import MARK

FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         "chat_template.jinja"}

# Copied by hand from each model's config.json on the hub, independently of modelzoo.PRESETS.
PUBLISHED = {
    # name: (arch, hidden, layers, heads, kv heads, head_dim, intermediate, max positions, vocab, rms_norm_eps, tied)
    "qwen2.5-0.5b": ("qwen2", 896, 24, 14, 2, 64, 4864, 32768, 151936, 1e-6, True),
    "qwen2.5-1.5b": ("qwen2", 1536, 28, 12, 2, 128, 8960, 131072, 151936, 1e-6, True),
    "qwen2.5-7b": ("qwen2", 3584, 28, 28, 4, 128, 18944, 131072, 152064, 1e-6, False),
    "qwen2.5-14b": ("qwen2", 5120, 48, 40, 8, 128, 13824, 131072, 152064, 1e-5, False),
    "qwen2.5-32b": ("qwen2", 5120, 64, 40, 8, 128, 27648, 131072, 152064, 1e-5, False),
    "qwen3-0.6b": ("qwen3", 1024, 28, 16, 8, 128, 3072, 40960, 151936, 1e-6, True),
    "qwen3-1.7b": ("qwen3", 2048, 28, 16, 8, 128, 6144, 40960, 151936, 1e-6, True),
}


@pytest.fixture(scope="module", params=ARCHS)
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def tiny(arch, tmp_path_factory):
    """One tiny model per arch, shared by the tests that only read it."""
    return make_model(tmp_path_factory.mktemp("zoo") / "tiny", arch=arch)


def test_writes_hub_layout(tiny):
    assert {p.name for p in tiny.iterdir()} == FILES | {MARK}  # the mark: a folder make-model may replace


def test_rebuild_is_byte_identical(arch, tiny, tmp_path):
    again = make_model(tmp_path / "again", arch=arch, preset="tiny", seed=0)
    for name in FILES:
        assert (again / name).read_bytes() == (tiny / name).read_bytes(), name


def test_seed_changes_weights_only(arch, tiny, tmp_path):
    other = make_model(tmp_path / "seed1", arch=arch, seed=1)
    assert (other / "model.safetensors").read_bytes() != (tiny / "model.safetensors").read_bytes()
    for name in FILES - {"model.safetensors"}:
        assert (other / name).read_bytes() == (tiny / name).read_bytes(), name


def test_build_leaves_caller_rng_alone(tmp_path):
    state = torch.get_rng_state()
    make_model(tmp_path / "m", seed=123)
    assert torch.equal(torch.get_rng_state(), state)


def test_loads_with_transformers(arch, tiny):
    model = AutoModelForCausalLM.from_pretrained(tiny)
    tok = AutoTokenizer.from_pretrained(tiny)
    assert model.config.architectures == [{"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]]
    assert model.dtype == torch.bfloat16
    assert model.config.vocab_size == 2048 and len(tok) == modelzoo.TOKENIZER_SIZE
    ids = (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    assert ids == (model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id)
    assert ids == (model.generation_config.bos_token_id, model.generation_config.eos_token_id,
                   model.generation_config.pad_token_id)
    with torch.no_grad():
        logits = model(**tok("Hello, world!", return_tensors="pt")).logits
    assert logits.shape[-1] == 2048 and torch.isfinite(logits).all()


def test_weights_are_bf16_and_norms_not_all_one(tiny):
    weights = load_file(tiny / "model.safetensors")
    assert {w.dtype for w in weights.values()} == {torch.bfloat16}
    norms = [w for name, w in weights.items() if "norm" in name]
    assert norms and all((w != 1).float().mean() > 0.9 for w in norms)


def test_chat_template(tiny):
    tok = AutoTokenizer.from_pretrained(tiny)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(messages, tokenize=False).endswith("Hi!<|im_end|>\n")
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and ids.count(tok.eos_token_id) == 2


@pytest.mark.parametrize("text", [
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces,\ttabs,\n\nnewlines and trailing spaces  ",
    "def f(x):\n    return x ** 2  # square\n",
    "Grüße aus Köln! Où est la bibliothèque ? ¿Qué tal?",
    "今天天气很好。日本語のテキストです。한국어 Ελληνικά",
    "e^(iπ) + 1 = 0, ∑ 1/k² = π²/6 😀🚀",
    "<|im_start|>user\nhi<|im_end|>",
])
def test_tokenizer_round_trips(tiny, text):
    tok = AutoTokenizer.from_pretrained(tiny)
    assert unicodedata.is_normalized("NFC", text)  # the tokenizer NFC-normalises, like Qwen's
    ids = tok(text)["input_ids"]
    assert ids[0] != tok.bos_token_id  # nothing is prepended
    assert tok.decode(ids) == text


def test_tokenizer_splits_digits_like_qwen(tiny):
    tok = AutoTokenizer.from_pretrained(tiny)
    assert tok.tokenize("2024") == ["2", "0", "2", "4"]


def test_num_layers_overrides_only_the_depth(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(make_model(tmp_path / "m", num_layers=2))
    assert model.config.num_hidden_layers == len(model.model.layers) == 2
    preset, deep = make_config().to_dict(), make_config(num_layers=8).to_dict()
    assert {k for k in preset if preset[k] != deep[k]} == {"num_hidden_layers", "layer_types"}
    with pytest.raises(ModelError, match="at least 1"):
        make_model(tmp_path / "none", num_layers=0)


@pytest.mark.parametrize("options, says", [
    ({"num_layers": 10**9}, "tiny with 1000000000 layers needs about"),
    ({"preset": "qwen2.5-7b"}, "qwen2.5-7b needs about"),
    ({"seed": 10**23}, "outside the seeds torch takes"),
])
def test_a_build_that_cannot_finish_is_refused_before_anything_is_allocated(options, says, tmp_path, monkeypatch):
    """The weights' bytes, counted from the config, against the RAM (here a machine with 4 GB); a seed torch refuses.
    Nothing is built: the refusal comes before the weights, and before the config of a billion layers."""
    monkeypatch.setenv("DIVERGENCE_PROBE_DEVICE_MEMORY", "4GB")
    monkeypatch.setattr(modelzoo, "_random_model", lambda *a: pytest.fail("the build started"))
    with pytest.raises(ModelError, match=says):
        make_model(tmp_path / "m", **options)
    assert list(tmp_path.iterdir()) == []


def test_a_gpu_build_is_measured_against_the_gpus_free_memory(tmp_path, monkeypatch):
    """--device cuda: the weights against the free memory torch reports for the GPU (here 4 GB of 80, on a machine
    whose RAM holds them), refused before anything is drawn or written."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (4 * 10**9, 80 * 10**9))
    monkeypatch.setattr(modelzoo, "_random_model", lambda *a: pytest.fail("the build started"))
    with pytest.raises(ModelError, match=r"qwen2.5-7b on cuda needs about 14\.\d GiB of its memory .* 3\.7 GiB is free "
                                         r"\(torch.cuda.mem_get_info\)"):
        make_model(tmp_path / "m", preset="qwen2.5-7b", device="cuda")
    assert list(tmp_path.iterdir()) == []


def test_a_gpu_build_needs_one_shard_of_ram_not_the_weights(tmp_path, monkeypatch):
    """A GPU build copies its weights to the host one shard at a time: a host whose RAM holds a shard but not the
    weights (8 GB against qwen2.5-7b's 15 GB) may build on the GPU, and is refused on the CPU."""
    from divergence_probe.models import size

    class Started(Exception):
        pass

    def started(*args):
        raise Started

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 * 10**9, 80 * 10**9))
    monkeypatch.setattr(size, "system_memory", lambda: (8 * 10**9, 16 * 10**9))
    monkeypatch.delenv(size.ENV, raising=False)
    monkeypatch.setattr(modelzoo.shutil, "disk_usage", lambda path: SimpleNamespace(free=10**12))  # the disk holds it
    monkeypatch.setattr(modelzoo, "_random_model", started)
    with pytest.raises(Started):
        make_model(tmp_path / "gpu", preset="qwen2.5-7b", device="cuda")
    with pytest.raises(ModelError, match="qwen2.5-7b needs about .* of RAM"):
        make_model(tmp_path / "cpu", preset="qwen2.5-7b", device="cpu")
    assert list(tmp_path.iterdir()) == []


def test_a_gpu_that_runs_out_of_memory_during_the_build_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    """Another process may take the GPU between the fit check and the draw: a ModelError naming the fix (the CLI's
    one line, exit 2), not a traceback, and no folder left behind."""
    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 * 10**9, 80 * 10**9))
    monkeypatch.setattr(modelzoo, "_random_model", out_of_memory)
    with pytest.raises(ModelError, match="ran out of its memory; free the GPU"):
        make_model(tmp_path / "m", device="cuda")
    assert list(tmp_path.iterdir()) == []


def test_preset_arch_mismatch(tmp_path):
    with pytest.raises(ModelError, match="qwen2"):
        make_model(tmp_path / "m", arch="qwen3", preset="qwen2.5-0.5b")
    with pytest.raises(ModelError, match="qwen3-0.6b"):
        make_model(tmp_path / "m", preset="qwen3-7b")
    with pytest.raises(ModelError, match="qwen2, qwen3"):
        make_model(tmp_path / "m", arch="llama")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("name, published", PUBLISHED.items())
def test_presets_have_published_shapes(name, published):
    arch, hidden, layers, heads, kv_heads, head_dim, intermediate, max_pos, vocab, eps, tied = published
    assert PRESETS[name].arch == arch
    config = make_config(preset=name)  # arch left out: the preset's own
    assert config.model_type == arch
    got = (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
           getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
           config.intermediate_size, config.max_position_embeddings)
    assert got == (hidden, layers, heads, kv_heads, head_dim, intermediate, max_pos)
    assert (config.vocab_size, config.rope_parameters["rope_theta"], config.rms_norm_eps) == (vocab, 1e6, eps)
    assert config.tie_word_embeddings is tied


def test_tiny_fits_both_archs():
    for arch in ARCHS:
        config = make_config(arch=arch, preset="tiny")
        assert config.model_type == arch
        assert config.hidden_size // config.num_attention_heads == PRESETS["tiny"].head_dim


def test_refuses_non_empty_out_dir(tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match="--overwrite"):
        make_model(out)
    with pytest.raises(OutputError, match="not a model directory"):
        make_model(out, overwrite=True)  # --overwrite deletes only what looks like a model
    assert (out / "notes.txt").read_text() == "mine"


def test_overwrite_replaces_a_model(tmp_path):
    out = make_model(tmp_path / "m", seed=0)
    before = (out / "model.safetensors").read_bytes()
    make_model(out, seed=1, overwrite=True)
    assert (out / "model.safetensors").read_bytes() != before
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_empty_out_dir_is_used(tmp_path):
    (tmp_path / "m").mkdir()
    assert {p.name for p in make_model(tmp_path / "m").iterdir()} == FILES | {MARK}


def test_unwritable_parent(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(OutputError, match="cannot write"):
        make_model(tmp_path / "file" / "m")


@pytest.mark.parametrize("exc", [RuntimeError("disk on fire"), KeyboardInterrupt()])
def test_failure_mid_write_leaves_nothing(tmp_path, monkeypatch, exc):
    def fail(*args, **kwargs):  # the tokenizer is already written when the weights fail
        raise exc

    monkeypatch.setattr(modelzoo, "_random_model", fail)
    with pytest.raises(type(exc)):
        make_model(tmp_path / "m")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("exc", [
    OSError(28, "No space left on device", "model.safetensors"),
    Exception("Error while serializing: I/O error: No space left on device (os error 28)"),  # safetensors' Rust
], ids=["OSError", "rust-writer"])
def test_full_disk_is_an_output_error_naming_the_folder(tmp_path, monkeypatch, exc):
    def fail(*args, **kwargs):
        raise exc

    monkeypatch.setattr(modelzoo, "_random_model", fail)
    with pytest.raises(OutputError, match=f"cannot write the model to {tmp_path / 'm'}: No space left on device"):
        make_model(tmp_path / "m")
    assert not any(tmp_path.iterdir())


def test_stop_between_the_renames_puts_the_old_model_back(tmp_path, monkeypatch):
    """--overwrite moves the old model aside, then renames the new one in: a signal between the two must not
    leave the user with neither."""
    model = make_model(tmp_path / "m", seed=0)
    before = (model / "model.safetensors").read_bytes()
    rename, calls = Path.rename, []

    def stopped_second(self, target):
        calls.append(self)
        if len(calls) == 2:  # the old model is aside, the new one not yet in place
            raise KeyboardInterrupt
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", stopped_second)
    with pytest.raises(KeyboardInterrupt):
        make_model(model, seed=1, overwrite=True)
    monkeypatch.undo()
    assert (model / "model.safetensors").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_default_model_is_the_shipped_trained_model(tmp_path, monkeypatch):
    monkeypatch.setenv("DIVERGENCE_PROBE_HOME", str(tmp_path / "home"))

    def no_build(*args, **kwargs):
        raise AssertionError("built a random model although the trained one ships")

    monkeypatch.setattr(modelzoo, "make_model", no_build)
    assert modelzoo.default_model_path() == modelzoo.SHIPPED_MODEL
    assert not (tmp_path / "home").exists()


def test_shipped_model_is_tiny_qwen3_with_the_modelzoo_tokenizer(tmp_path):
    shipped = modelzoo.SHIPPED_MODEL
    assert {p.name for p in shipped.iterdir()} == FILES | {"MODEL.md"}
    assert (shipped / "model.safetensors").stat().st_size <= 10 * 2**20
    random_tiny = make_model(tmp_path / "tiny", arch="qwen3", preset="tiny", seed=0)
    # the same shape, dtype and special tokens as the random tiny Qwen3, and the same tokenizer, byte for byte
    for name in FILES - {"model.safetensors"}:
        assert (shipped / name).read_bytes() == (random_tiny / name).read_bytes(), name
    weights = load_file(shipped / "model.safetensors")
    assert {w.dtype for w in weights.values()} == {torch.bfloat16}
    assert weights.keys() == load_file(random_tiny / "model.safetensors").keys()
    norms = [w for name, w in weights.items() if "norm" in name]  # trained, so not 1: rounding after x*w shows
    assert norms and all((w != 1).float().mean() > 0.9 for w in norms)


def test_shipped_model_is_peaked_on_python():
    model = AutoModelForCausalLM.from_pretrained(modelzoo.SHIPPED_MODEL)
    tok = AutoTokenizer.from_pretrained(modelzoo.SHIPPED_MODEL)
    code = "import os\n\n\ndef main(argv=None):\n    if argv is None:\n        argv = sys.argv[1:]\n    return 0\n"
    with torch.no_grad():
        logp = model(**tok(code, return_tensors="pt")).logits[0].float().log_softmax(-1)
    entropy = -(logp.exp() * logp).sum(-1).mean().item()
    assert entropy < 4.0  # 2.56 as shipped; random weights give 7.6 (uniform is 7.62). MODEL.md has the full numbers


def test_default_model_path_falls_back_to_building_once(tmp_path, monkeypatch):
    monkeypatch.setattr(modelzoo, "SHIPPED_MODEL", tmp_path / "not-shipped")  # an install without package data
    monkeypatch.setenv("DIVERGENCE_PROBE_HOME", str(tmp_path / "home"))
    path = modelzoo.default_model_path()
    assert path == tmp_path / "home" / "models" / f"qwen3-tiny-seed0-v{modelzoo.BUILD_VERSION}"
    expected = make_model(tmp_path / "expected", arch="qwen3", preset="tiny", seed=0)
    assert (path / "model.safetensors").read_bytes() == (expected / "model.safetensors").read_bytes()

    def no_rebuild(*args, **kwargs):
        raise AssertionError("the cached model was rebuilt")

    monkeypatch.setattr(modelzoo, "make_model", no_rebuild)
    assert modelzoo.default_model_path() == path


def test_default_model_path_loses_race_gracefully(tmp_path, monkeypatch):
    monkeypatch.setattr(modelzoo, "SHIPPED_MODEL", tmp_path / "not-shipped")
    monkeypatch.setenv("DIVERGENCE_PROBE_HOME", str(tmp_path))
    build = modelzoo.make_model

    def other_process_wins(out_dir, **kwargs):
        build(out_dir, **kwargs)  # the other process's rename lands first ...
        raise OutputError("written by someone else")  # ... so ours fails

    monkeypatch.setattr(modelzoo, "make_model", other_process_wins)
    assert (modelzoo.default_model_path() / "config.json").is_file()
