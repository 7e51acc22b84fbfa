"""Seeded random Qwen checkpoints in Hugging Face format, for tests and demos.

No model hub is reachable where divergence-probe is tested, so we build our own checkpoints: transformers'
own Qwen2/Qwen3/Qwen3-MoE classes with seeded random weights, saved the way the hub ships them (config.json, one BF16
model.safetensors, tokenizer, generation_config.json) so that transformers and vLLM both load them unchanged.
The named presets copy the shapes of published Qwen models, so kernels see the same sizes as in production;
`tiny` is 2 MB and builds in a fraction of a second once torch and transformers are imported.

    from pathlib import Path
    from divergence_probe.models.modelzoo import make_model
    make_model(Path("/tmp/qwen3-tiny"), arch="qwen3", preset="tiny", seed=0)

Same arch, preset, seed and device give byte-identical files (with the same torch and transformers versions).
`device="cuda"` draws the weights on the GPU, by its generator: other bytes than the CPU's for the same seed, in
seconds where a published shape takes the CPU minutes.

The default model (`default_model_path()`) is not random: it is the `tiny` Qwen3 trained on the Python standard
library by scripts/train_default_model.py and shipped in data/default_model/ (model card: MODEL.md there).
"""

import os
import re
import secrets
import shutil
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

from divergence_probe.errors import ModelError, OutputError
from divergence_probe.home import cache_home

# torch, tokenizers and transformers are imported inside the functions that build things, so that
# default_model_path() on an already built model (every CLI start) does not pay for importing them.

ARCHS = ("qwen2", "qwen3")  # the dense archs, which share the `tiny` shape
MOE_ARCHS = ("qwen3_moe",)  # mixture-of-experts archs: each has its own `tiny` (MOE_TINY)
MODEL = "model"  # the kind of output a checkpoint folder is marked as (rundir.mark)
SEEDS = (-2**63, 2**64 - 1)  # what torch.manual_seed takes
DEVICES = ("cpu", "cuda")  # where make_model draws the weights; each gives its own bytes for one seed
BUILD_VERSION = 1  # bump when the weights or tokenizer recipe changes, so cached default models are rebuilt

# arch -> config class in transformers; AutoModelForCausalLM maps each to Qwen2ForCausalLM / Qwen3ForCausalLM /
# Qwen3MoeForCausalLM
_CONFIG_CLASSES = {"qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "qwen3_moe": "Qwen3MoeConfig"}


@dataclass(frozen=True, kw_only=True)
class MoeShape:
    """The expert sizes of a mixture-of-experts preset; field names as in Qwen3MoeConfig."""

    num_experts: int  # transformers 5.x saves it as num_local_experts (Qwen3MoeConfig.attribute_map aliases them)
    num_experts_per_tok: int  # top-k
    moe_intermediate_size: int  # each expert's SwiGLU width
    norm_topk_prob: bool  # renormalise the top-k softmax probabilities to sum to 1


@dataclass(frozen=True, kw_only=True)
class Shape:
    """The sizes of one preset; the field names are those of the Hugging Face config."""

    arch: str | None  # the architecture the shape belongs to; None: any of ARCHS
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int  # Qwen2Config has no head_dim field: for qwen2 it must equal hidden_size // num_attention_heads
    intermediate_size: int
    vocab_size: int | None  # None: the tokenizer's size rounded up to a multiple of 64, as Qwen pads its vocab
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    moe: MoeShape | None = None  # None: a dense model; set exactly for the shapes of MOE_ARCHS


# Published shapes from each model's config.json on the Hugging Face hub (Qwen/<name>, base models).
PRESETS: dict[str, Shape] = {
    # head_dim 32 is one of the CPU attention backend's sizes (vllm/v1/attention/backends/cpu_attn.py,
    # get_supported_head_sizes), so vLLM runs it on CPU.
    "tiny": Shape(
        arch=None, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, intermediate_size=384, vocab_size=None, max_position_embeddings=2048,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
    ),
    "qwen2.5-0.5b": Shape(
        arch="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        head_dim=64, intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
    ),
    # The base model's context is 131072; Qwen2.5-1.5B-Instruct's config says 32768.
    "qwen2.5-1.5b": Shape(
        arch="qwen2", hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        head_dim=128, intermediate_size=8960, vocab_size=151936, max_position_embeddings=131072,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
    ),
    # Qwen2.5-7B and -14B (base models): the shapes RL users train most, for the memory plan and the scale runs.
    "qwen2.5-7b": Shape(
        arch="qwen2", hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        head_dim=128, intermediate_size=18944, vocab_size=152064, max_position_embeddings=131072,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
    ),
    "qwen2.5-14b": Shape(
        arch="qwen2", hidden_size=5120, num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8,
        head_dim=128, intermediate_size=13824, vocab_size=152064, max_position_embeddings=131072,
        rope_theta=1_000_000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
    # Qwen/Qwen2.5-32B (base) config.json: the dense shape of the several-GPU runs, 65 GB in BF16.
    "qwen2.5-32b": Shape(
        arch="qwen2", hidden_size=5120, num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8,
        head_dim=128, intermediate_size=27648, vocab_size=152064, max_position_embeddings=131072,
        rope_theta=1_000_000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
    "qwen3-0.6b": Shape(
        arch="qwen3", hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, intermediate_size=3072, vocab_size=151936, max_position_embeddings=40960,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
    ),
    "qwen3-1.7b": Shape(
        arch="qwen3", hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
        head_dim=128, intermediate_size=6144, vocab_size=151936, max_position_embeddings=40960,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
    ),
    # Qwen/Qwen3-30B-A3B config.json (the post-trained model that RL recipes start from; -Base differs only in
    # max_position_embeddings 32768): hidden_size 2048, num_hidden_layers 48, num_attention_heads 32,
    # num_key_value_heads 4, head_dim 128, intermediate_size 6144 (the dense MLP width, used only by
    # mlp_only_layers, which is []), max_position_embeddings 40960, rope_theta 1e6, rms_norm_eps 1e-6,
    # tie_word_embeddings false, vocab_size 151936; num_experts 128, num_experts_per_tok 8, moe_intermediate_size
    # 768, norm_topk_prob true, decoder_sparse_step 1 (every layer is MoE: the Qwen3MoeConfig default we keep).
    "qwen3-30b-a3b": Shape(
        arch="qwen3_moe", hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, intermediate_size=6144, vocab_size=151936, max_position_embeddings=40960,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        moe=MoeShape(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True),
    ),
}

# `--arch qwen3_moe --preset tiny`: not one of the published shapes, but one that keeps what routing depends on
# (many experts, top-k > 1, renormalised like Qwen3-30B-A3B) at a size that builds and runs on a CPU in seconds
# (about 8 MB). hidden 256 with 8 heads of 32: head_dim 32 runs on vLLM's CPU attention backend, as for `tiny`.
# The vocabulary, tokenizer, context and tied embeddings are `tiny`'s, so both tiny models share one tokenizer.
MOE_TINY = Shape(
    arch="qwen3_moe", hidden_size=256, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
    head_dim=32, intermediate_size=768, vocab_size=None,
    max_position_embeddings=PRESETS["tiny"].max_position_embeddings, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    moe=MoeShape(num_experts=32, num_experts_per_tok=4, moe_intermediate_size=64, norm_topk_prob=True),
)

# -----------------------------------------------------------------------------
# tokenizer

# Qwen's special tokens. BpeTrainer gives special tokens the first ids in this order: 0, 1, 2.
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
_SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
# Like Qwen3: a turn ends generation, <|endoftext|> pads (and is the config's bos, though nothing prepends it).
BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = ENDOFTEXT, IM_END, ENDOFTEXT

TOKENIZER_SIZE = 2000  # 3 special tokens + 256 bytes + 1741 merges learned from the corpus
_CORPUS = "data/tokenizer_corpus.txt"  # ships in the package, so every machine trains the same tokenizer

# Qwen2/Qwen3's pre-tokenizer split (from their tokenizer.json): contractions, words with one leading
# non-letter, single digits, punctuation runs, newlines, spaces. Using it makes our token boundaries fall
# where Qwen's do (for example, numbers become one token per digit).
_QWEN_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# ChatML as in Qwen's templates, without their tool-calling and thinking parts.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)


def build_tokenizer(model_max_length: int = PRESETS["tiny"].max_position_embeddings):
    """A byte-level BPE tokenizer trained on the packaged corpus, wrapped for transformers.

    Training is deterministic without any thread settings: the alphabet is sorted, pair counts are integer
    sums (so the order in which rayon threads add them does not matter), and equal counts are broken by
    the pair's token ids (tokenizers' bpe/trainer.rs, `impl Ord for Merge`).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = resources.files("divergence_probe").joinpath(_CORPUS).read_text(encoding="utf-8")
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_SIZE,
        special_tokens=list(_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, so any text encodes
        show_progress=False,
    )
    tok.train_from_iterator([corpus], trainer=trainer)
    assert tok.get_vocab_size() == TOKENIZER_SIZE, "the corpus is too small to learn TOKENIZER_SIZE tokens"
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,  # decode(encode(text)) must give text back, spaces included
    )


# -----------------------------------------------------------------------------
# config and weights


def _resolve_arch(arch: str | None, preset: str) -> str:
    """The preset's arch; the arch named by the user must agree with it."""
    if preset not in PRESETS:
        raise ModelError(f"unknown preset {preset!r}; choose one of: {', '.join(PRESETS)}")
    if arch is not None and arch not in ARCHS + MOE_ARCHS:
        raise ModelError(f"unknown arch {arch!r}; choose one of: {', '.join(ARCHS + MOE_ARCHS)}")
    implied = PRESETS[preset].arch
    if arch is not None and implied is not None and arch != implied:
        raise ModelError(f"preset {preset!r} is a {implied} model; pass --arch {implied} or leave --arch out")
    return arch or implied or "qwen3"


def _shape(arch: str, preset: str) -> Shape:
    """The sizes of `preset` built as `arch`: `tiny` is MOE_TINY for a mixture-of-experts arch."""
    return MOE_TINY if preset == "tiny" and arch in MOE_ARCHS else PRESETS[preset]


def make_config(*, arch: str | None = None, preset: str = "tiny", num_layers: int | None = None):
    """The transformers config for a preset, with our tokenizer's special-token ids; builds no weights.

    num_layers replaces the preset's num_hidden_layers (None: keep it).
    """
    import transformers

    arch = _resolve_arch(arch, preset)
    if num_layers is not None and num_layers < 1:
        raise ModelError(f"num_layers (--layers) must be at least 1, got {num_layers}; pass a positive depth")
    shape = _shape(arch, preset)
    config_cls = getattr(transformers, _CONFIG_CLASSES[arch])
    extra = {"head_dim": shape.head_dim} if arch != "qwen2" else {}  # qwen2 derives it from hidden_size
    if shape.moe is not None:
        extra.update(asdict(shape.moe))
    return config_cls(
        vocab_size=shape.vocab_size or -(-TOKENIZER_SIZE // 64) * 64,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers if num_layers is None else num_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=shape.max_position_embeddings,
        rope_theta=shape.rope_theta,
        rms_norm_eps=shape.rms_norm_eps,
        tie_word_embeddings=shape.tie_word_embeddings,
        bos_token_id=_SPECIAL_TOKENS.index(BOS_TOKEN),
        eos_token_id=_SPECIAL_TOKENS.index(EOS_TOKEN),
        pad_token_id=_SPECIAL_TOKENS.index(PAD_TOKEN),
        dtype="bfloat16",
        **extra,
    )


def _random_model(config, seed: int, device: str = "cpu"):
    """The model with weights drawn from `seed`, built directly in bfloat16 (2 bytes a parameter, not 4). On another
    device than the CPU the weights are drawn there, by its generator (other bytes than the CPU's for one seed)."""
    import torch
    import transformers

    # fork_rng: seeding must not change the caller's random state (the CPU's, and the device's when it draws)
    with torch.random.fork_rng(devices=[] if device == "cpu" else [torch.device(device)]), torch.no_grad():
        torch.manual_seed(seed)
        if device == "cpu":
            # _init_weights draws linear and embedding weights from normal(0, config.initializer_range)
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        else:  # laid out without memory, given its storage on the device once, then drawn in place there
            with torch.device("meta"):
                model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
            model.to_empty(device=device)
            model.init_weights()
        # _init_weights sets every RMSNorm weight to exactly 1, and x * 1 is exact in any dtype: a stack that
        # multiplies by the weight before rounding to bf16 and one that multiplies after would agree, hiding a
        # rounding difference that trained weights expose. N(1, 0.1) leaves about 2% of the bf16 weights at 1.
        for module in model.modules():
            if "RMSNorm" in type(module).__name__:
                module.weight.normal_(1.0, 0.1)
        # Qwen2's q/k/v biases start at zero, which would hide the rounding of the bias add in the same way.
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, config.initializer_range)
    model.generation_config = transformers.GenerationConfig(
        # Only the token ids: vLLM takes sampling defaults (temperature, top_p, ...) from this file too.
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
    )
    return model


def _write_model(out_dir: Path, arch: str, preset: str, seed: int, num_layers: int | None, device: str) -> None:
    """Write config, weights, tokenizer and generation config into the existing directory out_dir."""
    config = make_config(arch=arch, preset=preset, num_layers=num_layers)
    tokenizer = build_tokenizer(model_max_length=config.max_position_embeddings)
    assert [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id] == [
        config.bos_token_id, config.eos_token_id, config.pad_token_id
    ], "config and tokenizer disagree on special-token ids"
    tokenizer.save_pretrained(out_dir)
    model = _random_model(config, seed, device)
    if device == "cpu":
        # One shard at any preset size: model.safetensors is what a hub checkpoint of this size ships.
        model.save_pretrained(out_dir, max_shard_size="1000GB")
    else:  # save_pretrained would copy a mixture's experts on the device; this writer copies them to the host
        from . import get_family
        from .hub_layout import save_hub_layout

        save_hub_layout(model, out_dir, get_family(arch))
    # safetensors creates its file with mode 0600 whatever the umask; give every file the mode the umask gives
    # (out_dir was made with it), so that a shared cache is readable by everyone who can read the directory.
    mode = out_dir.stat().st_mode & 0o666
    for path in out_dir.iterdir():
        path.chmod(mode)


# -----------------------------------------------------------------------------
# public API

# The trained default model (scripts/train_default_model.py). A plain path, not importlib.resources: both stacks
# load a checkpoint from a folder on disk, and an install that has no such folder falls back to the random model.
SHIPPED_MODEL = Path(__file__).resolve().parents[1] / "data" / "default_model"


def make_model(
    out_dir: Path, *, arch: str | None = None, preset: str = "tiny", seed: int = 0, overwrite: bool = False,
    num_layers: int | None = None, device: str = "cpu",
) -> Path:
    """Build a random-weight checkpoint into out_dir and return out_dir.

    arch None means the preset's own arch (qwen3 for `tiny`, which fits both dense archs; `--arch qwen3_moe
    --preset tiny` is MOE_TINY). The files are written into a
    temporary sibling directory that is renamed to out_dir at the end, so out_dir is either absent or
    complete, even if the build fails or is interrupted.
    num_layers replaces the preset's number of decoder layers (None: the preset's), e.g. to see how a cost
    scales with depth; every other size stays the preset's.
    device (DEVICES) is where the weights are drawn: "cuda" draws them on the GPU, by its generator, so the bytes
    differ from the CPU's for the same seed, and writes them through the host in shards (hub_layout.py).
    """
    from ..rundir import mark, marked, refuse_link  # here: rundir imports pandas; default_model_path() must not

    out_dir = Path(out_dir).expanduser().absolute()
    refuse_link(out_dir)
    arch = _resolve_arch(arch, preset)
    if not SEEDS[0] <= seed <= SEEDS[1]:
        raise ModelError(f"--seed {seed} is outside the seeds torch takes ({SEEDS[0]} to {SEEDS[1]}); pass a smaller "
                         "seed")
    if device not in DEVICES:
        raise ModelError(f"--device {device!r} is not a device make-model draws on; choose {' or '.join(DEVICES)}")
    if device == "cuda":
        from ..environment import resolve_device

        resolve_device(device)  # refuses a machine whose torch sees no CUDA GPU
    _check_fits(out_dir, arch, preset, num_layers, device)
    if out_dir.exists():
        if not out_dir.is_dir():
            raise OutputError(f"{out_dir} is a file; choose a directory path")
        if any(out_dir.iterdir()):
            if not overwrite:
                raise OutputError(f"{out_dir} exists and is not empty; pass --overwrite or choose another path")
            # --overwrite deletes out_dir: only a checkpoint make-model wrote (its mark lists every file in it).
            if not marked(out_dir, MODEL):
                raise OutputError(f"{out_dir} is not a model directory make-model wrote (no divergence-probe mark, "
                                  "or files it did not write); will not overwrite it: choose another path")

    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    old = None
    try:  # from the folder's making on: a stop the moment it exists must remove it too
        try:
            out_dir.parent.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()  # not tempfile.mkdtemp: its mode 0700 would make a shared cache unreadable to others
        except OSError as e:
            raise OutputError(f"cannot write in {out_dir.parent}: {e.strerror}; choose another path") from None
        try:
            _write_model(tmp, arch, preset, seed, num_layers, device)
            mark(tmp, MODEL)
        except Exception as e:
            import torch

            if isinstance(e, torch.OutOfMemoryError):  # another process took the GPU after the fit check
                raise ModelError(f"building {preset} on {device} ran out of its memory; free the GPU, or pass fewer "
                                 "--layers or --device cpu") from e
            reason = _os_error(e)
            if reason is None:
                raise
            raise OutputError(f"cannot write the model to {out_dir}: {reason}; free space on that disk or choose "
                              "another path") from e
        if overwrite and out_dir.exists():
            if any(out_dir.iterdir()) and not marked(out_dir, MODEL):
                raise OutputError(f"{out_dir} changed during the build (it holds files make-model did not write); "
                                  "will not overwrite it: choose another path")
            old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
            out_dir.rename(old)
        try:
            tmp.rename(out_dir)  # atomic; fails if another process has filled out_dir since the check above
        except OSError:
            if old is not None:
                old.rename(out_dir)
                old = None
            raise OutputError(
                f"{out_dir} was written by someone else during the build; pass --overwrite or choose another path"
            ) from None
    except BaseException:  # BaseException: Ctrl-C or SIGTERM (signals.py) must not leave a half-written folder
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not out_dir.exists():  # stopped between the two renames: put the old model back
            old.rename(out_dir)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return out_dir


def _check_fits(out_dir: Path, arch: str, preset: str, num_layers: int | None, device: str) -> None:
    """Refuse, before anything is allocated, a build this machine cannot finish: the weights in bfloat16 against the
    free memory of the device that draws them (on the CPU with the libraries' allowance; safetensors writes them from
    the tensors' own memory, no copy), a GPU build's host copy of one shard and the libraries against the available
    RAM, and the weights again against the disk's free space. The parameters are counted on a one-layer config scaled
    to the depth: a config of a billion layers would itself take gigabytes."""
    from dataclasses import replace

    from . import get_family
    from .hub_layout import SHARD_BYTES
    from .size import CPU_RUNTIME, ENV, ModelSize, device_memory, gib

    one = make_config(arch=arch, preset=preset, num_layers=1)
    depth = _shape(arch, preset).num_hidden_layers if num_layers is None else num_layers
    size = replace(ModelSize.of(one.to_dict(), get_family(arch)), layers=depth)
    weights = 2 * size.parameters_from_config(bool(one.tie_word_embeddings), arch == "qwen2")
    what = f"{preset} with {depth} layers" if num_layers is not None else preset
    fix = f"choose a smaller --preset or fewer --layers, or run on a machine with more memory ({ENV}=BYTES if the " \
          "count is wrong)"
    if device != "cpu":
        free, _, source = device_memory(device)
        if weights > free:
            raise ModelError(f"building {what} on {device} needs about {gib(weights)} of its memory (the bfloat16 "
                             f"weights), and {gib(free)} is free ({source}); {fix}")
    host = weights if device == "cpu" else min(weights, SHARD_BYTES)  # a GPU build copies one shard at a time
    available, _, source = device_memory("cpu")
    if host + CPU_RUNTIME > available:
        held = "its bfloat16 weights" if device == "cpu" else "one shard of its weights"
        raise ModelError(f"building {what} needs about {gib(host + CPU_RUNTIME)} of RAM ({held} and the libraries), "
                         f"and {gib(available)} is available ({source}); {fix}")
    parent = next(p for p in (out_dir, *out_dir.parents) if p.exists())
    free = shutil.disk_usage(parent).free
    if weights > free:
        raise OutputError(f"{what}'s weights take about {gib(weights)} on disk, and {parent} has {gib(free)} free; "
                          "free space on that disk or choose another path")


def _os_error(e: BaseException) -> str | None:
    """The OS error behind a failed write, or None if it was not one: an OSError, or the `os error N` that the
    Rust writers of safetensors and tokenizers put in their own exception's message."""
    if isinstance(e, OSError):
        return f"{e.strerror or e} ({e.filename})" if e.filename else str(e.strerror or e)
    match = re.search(r"os error (\d+)", str(e))
    return f"{os.strerror(int(match.group(1)))} (errno {match.group(1)})" if match else None


def default_model_path() -> Path:
    """The built-in model: the trained tiny Qwen3 shipped in the package (data/default_model/, see MODEL.md).

    Only if that folder is missing (an install without package data) does it fall back to the random tiny Qwen3
    (seed 0), built into the cache on first use and reused after. The cache is home.cache_home()/models. No lock is needed: make_model renames a complete directory into
    place, so when two processes build at once one rename wins and the other process uses the winner's files,
    which are byte-identical to its own.
    """
    if (SHIPPED_MODEL / "config.json").is_file() and (SHIPPED_MODEL / "model.safetensors").is_file():
        return SHIPPED_MODEL
    path = cache_home() / "models" / f"qwen3-tiny-seed0-v{BUILD_VERSION}"  # a new build recipe gets a new cache entry
    if not (path / "config.json").is_file():
        try:
            make_model(path, arch="qwen3", preset="tiny", seed=0)
        except OutputError:
            if not (path / "config.json").is_file():
                raise
    return path
