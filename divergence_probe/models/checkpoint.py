"""Check, before either stack loads it, that a checkpoint folder holds exactly the model its config describes.

transformers and vLLM disagree on what to do with a checkpoint that does not fully describe its model: a tensor
the config needs but the files lack is random in transformers and never loaded in vLLM, a tensor the config does not
know is skipped by one and may break the other, a second *.safetensors file is read by vLLM only. Loaded
anyway, such a checkpoint makes the two stacks run different models, and the tool would report the difference
as rounding. So the files are checked against the model transformers builds from config.json (on the meta
device: shapes only, no memory), reading only the safetensors headers, and any disagreement is one ModelError
naming the tensor or field, the file and the fix.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelError, one_line
from ..versions import broken_import
from . import FAMILIES, Family, get_family

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
_HEADER_LIMIT = 100 * 1024 * 1024  # safetensors' own limit on the JSON header

# Fields both stacks read to size or run the model. transformers fills an absent one with its own default
# (hidden_size 4096, rope_theta 10000, ...), which is a guess, not this model.
REQUIRED_FIELDS = ("architectures", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "vocab_size", "rms_norm_eps", "max_position_embeddings")

# Any one of these sets is a tokenizer transformers can load for a Qwen model.
TOKENIZER_FILES = (("tokenizer.json",), ("vocab.json", "merges.txt"), ("tokenizer.model",))


@dataclass(frozen=True)
class Tensor:
    dtype: str
    shape: tuple[int, ...]
    file: str  # file name inside the checkpoint folder


def read_header(path: Path) -> dict[str, Tensor]:
    """The tensors a safetensors file declares (no tensor data is read), after checking the file holds all the
    bytes its header describes: a cut file would otherwise fail deep inside one stack with a traceback."""
    name = path.name
    redo = "re-copy or re-download the file"
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ModelError(f"{path} is truncated ({size} bytes, shorter than a safetensors header); {redo}")
            (n,) = struct.unpack("<Q", head)
            if n > _HEADER_LIMIT:
                raise ModelError(f"{path} is not a safetensors file (header length {n}); {redo}")
            raw = f.read(n)
    except OSError as e:
        raise ModelError(f"cannot read {path}: {e.strerror}; check the file's permissions or {redo}") from None
    if len(raw) < n:
        raise ModelError(f"{path} is truncated inside its header ({size} bytes, header alone needs {8 + n}); {redo}")
    try:
        header = json.loads(raw)
        tensors = {}
        end = 0
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            tensors[key] = Tensor(str(entry["dtype"]), tuple(int(d) for d in entry["shape"]), name)
            end = max(end, int(entry["data_offsets"][1]))
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise ModelError(f"{path} has a corrupt safetensors header ({type(e).__name__}: {one_line(e, 200)}); {redo}") from None
    if 8 + n + end > size:
        raise ModelError(f"{path} is truncated: its header describes {8 + n + end} bytes but the file has {size}; {redo}")
    return tensors


def checkpoint_tensors(folder: Path) -> dict[str, Tensor]:
    """Every tensor of the checkpoint, from model.safetensors or the shards an index lists.

    vLLM reads every *.safetensors file in the folder when there is no index (and only the indexed ones when
    there is); transformers reads model.safetensors or the index's shards. So without an index, any other
    *.safetensors file would be loaded by vLLM alone; with one, every shard must exist and hold exactly the
    tensors the index places in it."""
    index_path = folder / INDEX_FILE
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not index_path.is_file():
        if files != [SINGLE_FILE]:
            if SINGLE_FILE not in files:
                raise ModelError(f"{folder} has {', '.join(files)} but no {SINGLE_FILE} or {INDEX_FILE}: transformers "
                                 f"cannot find the weights; rename a single file to {SINGLE_FILE} or add the index")
            stray = ", ".join(f for f in files if f != SINGLE_FILE)
            raise ModelError(f"{folder} has {stray} besides {SINGLE_FILE}: vLLM would load those too and transformers "
                             f"would not; move {stray} out of the folder")
        return read_header(folder / SINGLE_FILE)
    try:
        weight_map = json.loads(index_path.read_bytes())["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map is not a mapping from tensor name to file name")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelError(f"cannot read the shard index {index_path} ({type(e).__name__}: {one_line(e, 200)}); re-copy or re-export "
                         "the checkpoint") from None
    shards = sorted(set(weight_map.values()))
    if (folder / SINGLE_FILE).is_file() and SINGLE_FILE not in shards:
        raise ModelError(f"{folder} has both {SINGLE_FILE} and {INDEX_FILE}, which does not list it: transformers would "
                         f"load {SINGLE_FILE} and vLLM the indexed shards; remove whichever is stale")
    missing = [s for s in shards if not (folder / s).is_file()]
    if missing:
        raise ModelError(f"{folder} lacks shard {missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                         + f" listed in {INDEX_FILE}; copy the missing shards into the folder")
    tensors: dict[str, Tensor] = {}
    for shard in shards:
        for key, tensor in read_header(folder / shard).items():
            if key in tensors:
                raise ModelError(f"tensor {key} is in both {tensors[key].file} and {shard} in {folder}: the stacks "
                                 "may load different copies; re-export the checkpoint")
            if weight_map.get(key) != shard:
                where = f"lists it in {weight_map[key]}" if key in weight_map else "does not list it"
                raise ModelError(f"{folder / shard} holds tensor {key} but {INDEX_FILE} {where}: vLLM and transformers "
                                 "would disagree on it; re-export the checkpoint or fix the index")
            tensors[key] = tensor
    absent = [k for k in weight_map if k not in tensors]
    if absent:
        raise ModelError(f"{INDEX_FILE} in {folder} lists tensor {absent[0]} in {weight_map[absent[0]]}, which does not "
                         "hold it; re-copy that shard or re-export the checkpoint")
    return tensors


def check_config(folder: Path, config: dict, family: Family) -> None:
    """Fields whose absence transformers would paper over with a default, and the two fields that pick the
    model class: transformers builds from model_type and vLLM from architectures, so they must agree."""
    arch, arch_class = config["model_type"], family.architecture
    for name in REQUIRED_FIELDS + family.required_config:
        if name not in config:
            raise ModelError(f"{folder / 'config.json'} has no {name!r}; both stacks would use a default that is not "
                             f"this model's: add the checkpoint's {name} to config.json")
    for names in family.required_any:
        if not any(n in config for n in names):
            raise ModelError(f"{folder / 'config.json'} has none of {', '.join(names)}; add the checkpoint's value "
                             f"under one of them")
    for name, value in family.fixed_config.items():
        if config.get(name, value) != value:
            raise ModelError(f"{folder / 'config.json'} sets {name}={config[name]!r}: {family.model_type} layers other "
                             f"than the default ({name}={value!r}) are not supported yet; use a checkpoint "
                             "whose every layer is sparse")
    rope = config.get("rope_parameters") or {}
    if "rope_theta" not in config and not (isinstance(rope, dict) and "rope_theta" in rope):
        raise ModelError(f"{folder / 'config.json'} has no rope_theta (nor rope_parameters.rope_theta); both stacks "
                         "would use a default that is not this model's: add the checkpoint's rope_theta")
    if config["architectures"] != [arch_class]:
        raise ModelError(f"{folder / 'config.json'} says model_type {arch!r} but architectures "
                         f"{config['architectures']}: transformers builds from the first and vLLM from the second; "
                         f"set architectures to [\"{arch_class}\"] or model_type to the weights' architecture")


def expected_tensors(folder: Path) -> tuple[dict[str, tuple[int, ...]], set[str], object]:
    """(name -> shape of every tensor the config's model has, names that may be absent because they are tied to
    another tensor, the transformers config), from the model built on the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(folder)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as e:  # a config transformers rejects (bad types, heads not dividing hidden_size, ...)
        broken = broken_import(e)  # or a library transformers imports for this model fails to import: not the config
        if broken is not None:
            raise broken from None
        raise ModelError(f"transformers cannot build a model from {folder / 'config.json'} ({type(e).__name__}: "
                         f"{one_line(e, 200)}); fix config.json") from None
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    return shapes, set(model.get_expanded_tied_weights_keys()), config



def _shape_fields(name: str, config, family: Family) -> str:
    return ", ".join(f"{f}={getattr(config, f, None)}" for f in family.shape_fields(name))


def _layers(names, family: Family) -> set[int]:
    pattern = re.escape(family.layer_prefix) + r"\.(\d+)\."
    return {int(m.group(1)) for n in names if (m := re.match(pattern, n))}


def check_weights(folder: Path, config: dict) -> None:
    """The tensors in the files are exactly those of the model config.json builds, with its shapes."""
    family = get_family(config["model_type"])
    found = checkpoint_tensors(folder)
    expected, tied, cfg = expected_tensors(folder)
    expected = family.checkpoint_shapes(expected, found)
    where = INDEX_FILE if (folder / INDEX_FILE).is_file() else SINGLE_FILE
    in_files = _layers(found, family)
    if in_files and in_files != set(range(cfg.num_hidden_layers)):
        raise ModelError(f"{folder / 'config.json'} says num_hidden_layers={cfg.num_hidden_layers} but {where} has "
                         f"layers {min(in_files)}..{max(in_files)} ({len(in_files)} layers); set num_hidden_layers to "
                         "match the weights or re-export the checkpoint")
    arch = config["model_type"]
    missing = [n for n in expected if n not in found and n not in tied]
    unexpected = [n for n in found if n not in expected]
    if missing or unexpected:
        for other in FAMILIES:  # the weights of the other architecture?
            if other != arch and _matches(found, folder, other):
                raise ModelError(f"{folder / 'config.json'} says {arch} ({family.architecture}) but the weights in "
                                 f"{where} are a {other} model's; set model_type to {other!r} and architectures to "
                                 f"[\"{get_family(other).architecture}\"]")
    if missing:
        name, more = missing[0], f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        fix = ("set tie_word_embeddings to true if the output layer shares the embedding, or add lm_head.weight"
               if name == "lm_head.weight" else "re-export the checkpoint with all its weights")
        tie = f" while config.json says tie_word_embeddings={cfg.tie_word_embeddings}" if name == "lm_head.weight" else ""
        raise ModelError(f"{where} in {folder} lacks tensor {name}{more}{tie}: transformers would initialise it at random "
                         f"and vLLM would not load it at all; {fix}")
    if unexpected:
        name, more = unexpected[0], f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise ModelError(f"{found[name].file} in {folder} has tensor {name}{more}, which {family.architecture} from "
                         "config.json does not have: the stacks would treat it differently; remove it or fix config.json")
    for name, shape in expected.items():
        if name in found and found[name].shape != shape:
            raise ModelError(f"{found[name].file} in {folder}: tensor {name} has shape {list(found[name].shape)} but "
                             f"config.json ({_shape_fields(name, cfg, family)}) makes it {list(shape)}; fix those fields in "
                             "config.json to match the weights, or re-export the checkpoint")
    for name, tensor in found.items():
        if tensor.dtype not in FLOAT_DTYPES:
            raise ModelError(f"{tensor.file} in {folder}: tensor {name} is {tensor.dtype}, not a float type "
                             "(quantized checkpoints are not supported); use the unquantized checkpoint")
    _check_tied_copy(folder, found, tied, cfg, family)


def _matches(found: dict[str, Tensor], folder: Path, arch: str) -> bool:
    """Whether the tensor names are exactly those of `arch` built with the folder's other config fields."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = json.loads((folder / "config.json").read_bytes())
    try:
        config = AutoConfig.for_model(arch, **{k: v for k, v in fields.items() if k not in ("model_type", "architectures")})
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # the other architecture cannot even be built from this config: not a match
        return False
    names, tied = set(model.state_dict()), set(model.get_expanded_tied_weights_keys())
    return set(found) <= names and not (names - set(found) - tied)


def _check_tied_copy(folder: Path, found: dict[str, Tensor], tied: set[str], cfg, family: Family) -> None:
    """A tied checkpoint may also ship the tied copy, but only an identical one: for a different lm_head.weight
    vLLM still ties (skips it) while transformers unties (uses it), so the two would run different output layers."""
    for name in tied & set(found):
        from safetensors import safe_open
        import torch

        source = family.tied_head[1]
        if source not in found:
            continue
        with safe_open(folder / found[name].file, "pt") as a, safe_open(folder / found[source].file, "pt") as b:
            same = torch.equal(a.get_tensor(name), b.get_tensor(source))
        if not same:
            raise ModelError(f"{found[name].file} in {folder} has its own {name}, but config.json says "
                             f"tie_word_embeddings={cfg.tie_word_embeddings}: vLLM would use {source} in its place and "
                             "transformers would use it; set tie_word_embeddings to false to use it, or remove it")


def check_tokenizer(folder: Path, vocab_size: int) -> None:
    """A tokenizer is in the folder and fits the model: without one, transformers builds an empty tokenizer and
    every prompt has 0 tokens; one from a bigger model makes token ids the embedding does not have."""
    if not any(all((folder / f).is_file() for f in files) for files in TOKENIZER_FILES):
        names = " or ".join(" + ".join(files) for files in TOKENIZER_FILES)
        raise ModelError(f"{folder} has no tokenizer ({names}); copy the tokenizer files of the model the weights "
                         "come from into it, e.g. AutoTokenizer.from_pretrained(base).save_pretrained(folder)")
    path = folder / "tokenizer.json"
    if not path.is_file():
        return
    try:
        data = json.loads(path.read_bytes())
        vocab = data["model"]["vocab"]  # BPE/WordPiece: token -> id; Unigram: a list in id order
        ids = [int(i) for i in (vocab.values() if isinstance(vocab, dict) else range(len(vocab)))]
        ids += [int(t["id"]) for t in data.get("added_tokens") or []]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ModelError(f"{path} is not a readable tokenizer ({type(e).__name__}: {one_line(e, 200)}); re-copy it from "
                         "the model the weights come from") from None
    if ids and max(ids) >= vocab_size:
        raise ModelError(f"{path} has token ids up to {max(ids)} but config.json says vocab_size={vocab_size}: the "
                         "tokenizer belongs to another model; copy the tokenizer of the model the weights come from")
