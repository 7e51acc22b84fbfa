"""Resolve `--model` to one local checkpoint folder that both stacks load, and check it is one we understand
(the file-level checks are in models/checkpoint.py).

A hub id is downloaded once, here, so vLLM and transformers read the very same files; both stacks are
then given the local path and never touch the network.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from .checkpoint import check_config, check_tokenizer, check_weights
from ..errors import ModelError
from . import FAMILIES, Family, get_family

MAX_CONTEXT = 8192  # longest prompt+1 the engines are sized for; bounds vLLM's KV cache on small machines
_HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken"]


@dataclass(frozen=True)
class ModelSource:
    spec: str  # what the user asked for: a path or a hub id
    path: Path  # the local folder both stacks load
    config: dict
    config_sha256: str

    @property
    def arch(self) -> str:
        return self.config["model_type"]

    @property
    def num_layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def family(self) -> Family:
        """What the stacks, capture and checks know about this architecture (models/)."""
        return get_family(self.arch)

    @property
    def max_model_len(self) -> int:
        return min(int(self.config.get("max_position_embeddings", MAX_CONTEXT)), MAX_CONTEXT)


def _looks_like_path(spec: str) -> bool:
    return spec.startswith((".", "/", "~")) or spec.count("/") != 1 or Path(spec).exists()


def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=_HUB_FILES))
    except Exception as e:  # offline, unknown repo, gated repo: all mean "not available here"
        raise ModelError(
            f"could not fetch {repo_id!r} from the Hugging Face Hub ({type(e).__name__}: {str(e)[:200]}). "
            "Without network access, build a local Qwen-architecture model with "
            "`divergence-probe make-model ./my-model --preset qwen2.5-1.5b` and pass --model ./my-model"
        ) from e


def resolve_model(spec: str | None) -> ModelSource:
    """A local path, a hub id, or None for the built-in default model."""
    if spec is None:
        from .modelzoo import default_model_path

        path, spec = default_model_path(), "builtin:default"
    elif _looks_like_path(spec):
        path = Path(spec).expanduser()
        if not path.is_dir():
            raise ModelError(f"model path {spec} does not exist or is not a folder; pass a checkpoint folder "
                             "(config.json + *.safetensors) or a hub id such as Qwen/Qwen2.5-1.5B")
    else:
        path = _download(spec)
    config_file = path / "config.json"
    try:
        raw = config_file.read_bytes()
        config = json.loads(raw)
    except (OSError, json.JSONDecodeError) as e:
        raise ModelError(f"cannot read {config_file}: {e}; is {path} a Hugging Face checkpoint folder? If so, "
                         "re-copy its config.json") from e
    if not isinstance(config, dict) or "model_type" not in config:
        raise ModelError(f"{config_file} has no 'model_type'; add the checkpoint's, e.g. \"model_type\": \"qwen3\"")
    arch = config.get("model_type")
    if arch not in FAMILIES:
        known = [get_family(name) for name in FAMILIES]
        raise ModelError(
            f"{spec} is a {arch or 'unknown'!s} model; divergence-probe supports "
            f"{', '.join(FAMILIES)} ({', '.join(f.architecture for f in known)})"
        )
    if not any(path.glob("*.safetensors")):
        raise ModelError(f"{path} has no *.safetensors weights; save the model with safe_serialization=True")
    # Before either stack loads: what the two would load differently, or fail on with a traceback.
    check_config(path, config, get_family(arch))
    check_weights(path, config)
    check_tokenizer(path, int(config["vocab_size"]))
    return ModelSource(spec=spec, path=path.resolve(), config=config, config_sha256=hashlib.sha256(raw).hexdigest())
