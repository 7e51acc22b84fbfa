"""Pure tensor -> number functions: tensor diffs at a tap, and token-level logprob/KL comparisons.

Conventions: `test` is the inference side, `ref` the training side (the policy the gradient is taken
for), so relative errors are measured against what the trainer computes.

Elementwise work runs in FP32 for 16-bit tensors (a product of two BF16/FP16 values is exact in FP32, and so
is their difference unless their exponents are more than 16 apart) and in FP64 for FP32 tensors; every sum
is taken in FP64. The reported error is the stacks' error and not ours; sums run over fixed shapes in a fixed
order, which keeps every number reproducible byte for byte on the same machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

# dtype -> (its bits as an integer type, an integer type wide enough for differences of ordered patterns)
_BITS = {torch.bfloat16: (torch.int16, torch.int32), torch.float16: (torch.int16, torch.int32),
         torch.float32: (torch.int32, torch.int64)}


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise distance between a and b in units in the last place of their (common) dtype.

    Floats are sign-magnitude; mapping the bit pattern to `±magnitude` makes the integers monotone in the
    value (and maps -0 and +0 both to 0), so the integer difference counts representable values between.
    """
    int_dtype, wide = _BITS[a.dtype]
    sign_mask = torch.iinfo(int_dtype).max  # every bit but the sign

    def ordered(x: torch.Tensor) -> torch.Tensor:
        bits = x.view(int_dtype).to(wide)
        return torch.where(bits < 0, -(bits & sign_mask), bits)

    return (ordered(a) - ordered(b)).abs()


@dataclass(frozen=True)
class DiffStats:
    """Sufficient statistics of `test - ref` over any number of elements; merging is exact bookkeeping.

    Keeping sums (not per-prompt ratios) makes the aggregate over prompts the same number one would get
    from one concatenated tensor, independent of how prompts were grouped.
    """

    n: int = 0
    n_equal: int = 0
    sum_abs: float = 0.0
    max_abs: float = 0.0
    sum_sq_diff: float = 0.0
    sum_sq_ref: float = 0.0
    sum_sq_test: float = 0.0
    dot: float = 0.0
    max_ulp: int = 0

    @classmethod
    def of(cls, test: torch.Tensor, ref: torch.Tensor) -> "DiffStats":
        if test.shape != ref.shape:
            raise ValueError(f"shape mismatch: {tuple(test.shape)} vs {tuple(ref.shape)}")
        if test.dtype != ref.dtype:
            raise ValueError(f"dtype mismatch: {test.dtype} vs {ref.dtype}")
        work = torch.float64 if test.dtype == torch.float32 else torch.float32
        t, r = test.to(work), ref.to(work)
        d = t - r
        abs_d = d.abs()
        # .double().sum() rather than sum(dtype=...): the latter takes a much slower path on CPU.
        # One device->host transfer per tap: counts are exact in float64 (below 2**53).
        stats = torch.stack([
            abs_d.double().sum(), abs_d.max().double(), (d * d).double().sum(), (r * r).double().sum(),
            (t * t).double().sum(), (t * r).double().sum(), (d == 0).sum().double(),
            ulp_distance(test, ref).max().double(),
        ]).tolist()
        return cls(test.numel(), int(stats[6]), *stats[:6], int(stats[7]))

    def merge(self, other: "DiffStats") -> "DiffStats":
        return DiffStats(
            n=self.n + other.n,
            n_equal=self.n_equal + other.n_equal,
            sum_abs=self.sum_abs + other.sum_abs,
            max_abs=max(self.max_abs, other.max_abs),
            sum_sq_diff=self.sum_sq_diff + other.sum_sq_diff,
            sum_sq_ref=self.sum_sq_ref + other.sum_sq_ref,
            sum_sq_test=self.sum_sq_test + other.sum_sq_test,
            dot=self.dot + other.dot,
            max_ulp=max(self.max_ulp, other.max_ulp),
        )

    @property
    def mean_abs(self) -> float:
        return self.sum_abs / self.n if self.n else float("nan")

    @property
    def rel_l2(self) -> float:
        """‖test−ref‖/‖ref‖; 0 when both are identical, inf when ref is all zeros but test is not."""
        if self.sum_sq_diff == 0.0:
            return 0.0
        return math.sqrt(self.sum_sq_diff) / math.sqrt(self.sum_sq_ref) if self.sum_sq_ref else math.inf

    @property
    def cosine(self) -> float:
        denom = math.sqrt(self.sum_sq_test) * math.sqrt(self.sum_sq_ref)
        return self.dot / denom if denom else (1.0 if self.sum_sq_diff == 0.0 else 0.0)

    @property
    def frac_equal(self) -> float:
        return self.n_equal / self.n if self.n else float("nan")

    @property
    def bitwise_equal(self) -> bool:
        return self.n > 0 and self.n_equal == self.n

    def row(self) -> dict[str, float | int]:
        """The columns of layers.csv."""
        return {
            "max_abs": self.max_abs,
            "mean_abs": self.mean_abs,
            "rel_l2": self.rel_l2,
            "cosine": self.cosine,
            "frac_equal": self.frac_equal,
            "max_ulp": self.max_ulp,
        }


STAT_FIELDS = tuple(f.name for f in fields(DiffStats))


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log_softmax over FP32 logits at the target ids, as a trainer computes its policy logprobs.

    logits: [T, V] in the stack's dtype; targets: [T]. The upcast is exact; the softmax runs in FP32
    because that is what both vLLM's sampler and RL trainers do.
    """
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[:, None])[:, 0]


def token_kl(infer_logits: torch.Tensor, train_logits: torch.Tensor, rows_per_chunk: int = 256) -> torch.Tensor:
    """Exact KL(π_infer ‖ π_train) per position over the full vocabulary, in float64.

    Computed from the stacks' own logits (upcast exactly to float64), so the KL measures the stacks'
    disagreement and not rounding in our own softmax. Chunked over rows to bound memory at real vocab sizes.
    """
    out = []
    for start in range(0, infer_logits.shape[0], rows_per_chunk):
        lp = torch.log_softmax(infer_logits[start : start + rows_per_chunk].double(), dim=-1)
        lq = torch.log_softmax(train_logits[start : start + rows_per_chunk].double(), dim=-1)
        # clamp: exact KL is >= 0; float64 cancellation can leave -1e-17 on identical rows with ties.
        out.append((lp.exp() * (lp - lq)).sum(-1).clamp_min(0.0))
    return torch.cat(out) if out else infer_logits.new_zeros(0, dtype=torch.float64)
