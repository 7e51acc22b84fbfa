"""How many torch ops the weight check's comparison dispatches, before and after the batched comparison (rl/sync.py:
`differing` and `fingerprints`), for the tensors of one engine at a given shape: on a GPU each op is at least one
kernel launch, and at the 1.5B shape the per-tensor comparison was launch-bound (docs/results/rl/h200-verify/README.md).

    PYTHONPATH=$PWD .venv/bin/python docs/results/rl/h200-verify/count_ops.py [PRESET]    # default qwen2.5-1.5b

The tensors are the engine's of PRESET (vLLM's layout: qkv_proj and gate_up_proj fused, one lm_head) at 1/64 of
each dimension (the op count does not depend on the sizes, only on how many tensors there are), BF16, on the CPU.
"before" re-runs the per-tensor comparison of commit 8271cd5 (sync.same_values and sync.fingerprint per tensor, two
torch.stack and read-backs); "after" is rl/sync.py's `differing` and `fingerprints`.
"""

import json
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from divergence_probe import modelzoo as z
from divergence_probe.rl.sync import differing, fingerprints, same_values


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def engine_shapes(preset: str) -> list[tuple[int, ...]]:
    c = z.make_config(preset=preset)
    h, q = c.hidden_size // 64, c.num_attention_heads * (c.hidden_size // c.num_attention_heads) // 64
    kv = c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) // 64
    inter, vocab = c.intermediate_size // 64, c.vocab_size // 64
    layer = [(h,), (q + 2 * kv, h), (q + 2 * kv,), (h, q), (h,), (2 * inter, h), (h, inter)]  # qwen2: qkv bias
    return [(vocab, h)] + layer * c.num_hidden_layers + [(h,), (vocab, h)]


def before(have, want):
    equal = [same_values(a, b) for a, b in zip(have, want)]
    prints = [torch.stack([a.sum(dtype=torch.float64), torch.linalg.vector_norm(a, dtype=torch.float64)])
              for a in have]
    return torch.stack(equal).tolist(), torch.stack(prints).tolist()


def after(have, want):
    return differing(have, want), fingerprints(have)


def main(preset: str) -> None:
    g = torch.Generator().manual_seed(0)
    have = [torch.randn(s, generator=g).bfloat16() for s in engine_shapes(preset)]
    want = [t.clone() for t in have]
    result = {"preset": preset, "tensors": len(have)}
    for name, fn in (("before", before), ("after", after)):
        with Count() as count:
            fn(have, want)
        result[f"ops_{name}"] = count.ops
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-1.5b")
