"""How many torch ops the weight check's comparison dispatches, for the tensors of one engine at a given shape, in
three versions of rl/sync.py: on a GPU each op is at least one kernel launch, and at the 1.5B shape the per-tensor
comparison was launch-bound (docs/results/rl/h200-verify/README.md). Also how many bytes of fused weights the check
copied per step to build its expectation (`torch.cat` of q/k/v and of gate/up, at the preset's full size, BF16).

    PYTHONPATH=$PWD .venv/bin/python docs/results/rl/h200-verify/count_ops.py [PRESET]    # default qwen2.5-1.5b

The tensors are the engine's of PRESET (vLLM's layout: qkv_proj and gate_up_proj fused, one lm_head) at 1/64 of
each dimension (the op count does not depend on the sizes, only on how many tensors there are), BF16, on the CPU.
"before" re-runs the per-tensor comparison of commit 8271cd5 (sync.same_values and sync.fingerprint per tensor, two
torch.stack and read-backs); "batched" that of commit 6307825 (the fused expectations concatenated, `differing`, a
float64 sum per tensor beside `_foreach_norm`); "after" is rl/sync.py's: each source against its rows of the engine's
tensor (views), `differing`, `fingerprints`. Views are not counted (no kernel), nor is the concatenation (one op
per fused tensor).
"""

import json
import math
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
        self.ops += not func.is_view  # a view (a row slice of the engine's tensor) launches no kernel
        return func(*args, **(kwargs or {}))


def engine_layout(preset: str, scale: int = 64) -> list[list[tuple[int, ...]]]:
    """Per engine tensor, the shapes of the trainer's tensors stacked into it (one for an unfused tensor), with
    every dimension divided by `scale`."""
    c = z.make_config(preset=preset)
    h, q = c.hidden_size // scale, c.num_attention_heads * (c.hidden_size // c.num_attention_heads) // scale
    kv = c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) // scale
    inter, vocab = c.intermediate_size // scale, c.vocab_size // scale
    layer = [[(h,)], [(q, h), (kv, h), (kv, h)], [(q,), (kv,), (kv,)], [(h, q)], [(h,)],  # qwen2: qkv bias
             [(inter, h), (inter, h)], [(h, inter)]]
    return [[(vocab, h)]] + layer * c.num_hidden_layers + [[(h,)], [(vocab, h)]]


def before(have, want, parts):
    equal = [same_values(a, b) for a, b in zip(have, want)]
    prints = [torch.stack([a.sum(dtype=torch.float64), torch.linalg.vector_norm(a, dtype=torch.float64)])
              for a in have]
    return torch.stack(equal).tolist(), torch.stack(prints).tolist()


def batched(have, want, parts):
    sums = [t.sum(dtype=torch.float64) for t in have]
    norms = torch._foreach_norm(have, 2, dtype=torch.float64)
    return differing(have, want), torch.stack([torch.stack(sums), torch.stack(norms)], dim=1).tolist()


def after(have, want, parts):
    views = [v for t, p in zip(have, parts) for v in t.split([s.shape[0] for s in p])]
    return differing(views, [s for p in parts for s in p]), fingerprints(have)


def main(preset: str) -> None:
    g = torch.Generator().manual_seed(0)
    parts = [[torch.randn(s, generator=g).bfloat16() for s in shapes] for shapes in engine_layout(preset)]
    have = [torch.cat(p) for p in parts]  # the engine's tensors (a copy of the trainer's, as after a push)
    want = [torch.cat(p) for p in parts]  # the expectation as commit 6307825 built it: the fused ones concatenated
    fused = [shapes for shapes in engine_layout(preset, scale=1) if len(shapes) > 1]
    result = {"preset": preset, "tensors": len(have),
              "fused_bytes_copied_before": 2 * sum(math.prod(s) for shapes in fused for s in shapes)}
    for name, fn in (("before", before), ("batched", batched), ("after", after)):
        with Count() as count:
            fn(have, want, parts)
        result[f"ops_{name}"] = count.ops
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-1.5b")
