"""Pure tensor -> number functions: tensor diffs at a tap, and token-level logprob/KL comparisons.

Conventions: `test` is the inference side, `ref` the training side (the policy the gradient is taken
for), so relative errors are measured against what the trainer computes.

Elementwise work runs in FP32 for 16-bit tensors (a product of two BF16/FP16 values is exact in FP32, and so
is their difference unless their exponents are more than 16 apart) and in FP64 for FP32 tensors; sums end
in FP64 (`_row_sums` bounds their error). The reported error is the stacks' error and not ours; sums run over
fixed shapes in an order fixed by the kernel that runs them (eager or compiled, numerics/fused.py), which keeps every number reproducible byte
for byte on the same machine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# dtype -> (its bits as an integer type, an integer type wide enough for differences of ordered patterns)
_BITS = {torch.bfloat16: (torch.int16, torch.int32), torch.float16: (torch.int16, torch.int32),
         torch.float32: (torch.int32, torch.int64)}


def _signed_bits(x: torch.Tensor) -> torch.Tensor:
    """x's bit pattern as a sign-extended integer, wide enough to add two magnitudes without overflow."""
    if x.dtype == torch.bfloat16:
        # A bf16 is the top half of its exact FP32 upcast. Taken this way the bits vectorize under
        # torch.compile on CPU; an int16 view does not (it made the whole fused reduction scalar).
        return x.float().view(torch.int32) >> 16
    int_dtype, wide = _BITS[x.dtype]
    return x.view(int_dtype).to(wide)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise distance between a and b in units in the last place of their (common) dtype.

    Floats are sign-magnitude and, for one sign, consecutive magnitudes are consecutive integers: two values of
    the same sign are |mag_a - mag_b| steps apart, values of opposite signs mag_a + mag_b steps (through zero;
    -0 and +0 both have magnitude 0).
    """
    magnitude_bits = torch.iinfo(_BITS[a.dtype][0]).max  # every bit but the sign
    ia, ib = _signed_bits(a), _signed_bits(b)
    mag_a, mag_b = ia & magnitude_bits, ib & magnitude_bits
    return torch.where((ia ^ ib) < 0, mag_a + mag_b, (mag_a - mag_b).abs())


DIFF_SUM_FIELDS = ("n_equal", "sum_abs", "max_abs", "sum_sq_diff", "sum_sq_ref", "sum_sq_test", "max_ulp")
DIFF_SUM_IS_MAX = tuple(name.startswith("max_") for name in DIFF_SUM_FIELDS)  # merged by max; the others add

_BLOCK = 64


def _row_sums(x: torch.Tensor) -> torch.Tensor:
    """Row sums of [..., n] into FP64 [...]: in blocks of 64 in x's dtype first, then the block sums in FP64.

    For 16-bit taps the terms are FP32 and each is exact or one rounding away (products of two 16-bit values
    are exact in FP32), so a block sum carries at most 63 roundings, 4e-6 relative in the worst case and ~1e-7
    typically; every sum DiffStats reports is then this accurate. Vectorized FP32 blocks run faster on CPU than
    FP64 throughout. A length that is no multiple of 64 is summed in FP64 directly.
    """
    if x.shape[-1] % _BLOCK:
        return x.double().sum(-1)
    return x.unflatten(-1, (-1, _BLOCK)).sum(-1).double().sum(-1)


def row_diff_sums(test: torch.Tensor, ref: torch.Tensor, row_sums=_row_sums) -> torch.Tensor:
    """diff_sums of [..., n] pairs -> FP64 [..., 7], each row (last dimension) reduced on its own;
    row_sums([..., n]) -> FP64 [...]."""
    work = torch.float64 if test.dtype == torch.float32 else torch.float32
    t, r = test.to(work), ref.to(work)
    d = t - r
    abs_d = d.abs()
    # No t*r sum: the dot product follows from the other three (DiffStats.dot), and inductor's CPU kernel ran
    # slower with it.
    return torch.stack([
        (d == 0).sum(-1).double(), row_sums(abs_d), abs_d.amax(-1).double(), row_sums(d * d), row_sums(r * r),
        row_sums(t * t), ulp_distance(test, ref).amax(-1).double(),
    ], dim=-1)


def diff_sums(test: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """What DiffStats keeps of each pair `test[i]`, `ref[i]` (DIFF_SUM_FIELDS: its fields after n, in order):
    float64 [rows, 7] on the tensors' device.

    Written as expressions over the same elements so that torch.compile fuses them into one read of both
    tensors (numerics/fused.py). Counts and maxima are exact in float64 (below 2**53). A GPU reduces in blocks first
    (`blocks_first`), the CPU one row per pair (one thread per row is what its kernel parallelizes over anyway).
    """
    if test.is_cuda and test.shape[-1] % _BLOCK == 0:
        return blocks_first(test, ref)
    return row_diff_sums(test.reshape(len(test), -1), ref.reshape(len(ref), -1))


def blocks_first(test: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """diff_sums with every statistic taken per block of 64 elements first (counts and maxima exact, the sums
    those of `_row_sums`), then each pair's blocks merged in FP64 (sums add, maxima take the max).

    A GPU reduction runs one thread block per output row: with one row per pair (a logits tap is one row of
    150M elements) most of the device sat idle; docs/results/h200/compiled/README.md compares the layouts.

    Each pair is cut into blocks within itself (`[pairs, -1, 64]`), a view of any pair whose rows are contiguous:
    a compiled engine hands over its taps as `[taps, tokens, features]` slices of larger buffers, and flattening
    those across pairs (`[-1, 64]`) cannot be a view, so inductor indexed every element through a division by the
    symbolic token count (docs/results/h200/compiled/strided_reduction.json measures it).
    """
    blocks = (len(test), -1, _BLOCK)
    per_block = row_diff_sums(test.reshape(blocks), ref.reshape(blocks), lambda x: x.sum(-1).double())
    return merge_row_sums(per_block, len(test))


def merge_row_sums(per_row: torch.Tensor, pairs: int) -> torch.Tensor:
    """[pairs, ..., 7] (or [pairs * k, 7]) diff_sums of k consecutive pieces per pair -> [pairs, 7]: sums add,
    maxima take the max."""
    per_row = per_row.view(pairs, -1, len(DIFF_SUM_FIELDS))
    sums, maxima = per_row.sum(1), per_row.amax(1)
    return torch.stack([maxima[:, i] if is_max else sums[:, i] for i, is_max in enumerate(DIFF_SUM_IS_MAX)], dim=1)


def check_pair(test: torch.Tensor, ref: torch.Tensor) -> None:
    if test.shape != ref.shape:
        raise ValueError(f"shape mismatch: {tuple(test.shape)} vs {tuple(ref.shape)}")
    if test.dtype != ref.dtype:
        raise ValueError(f"dtype mismatch: {test.dtype} vs {ref.dtype}")


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
    max_ulp: int = 0

    @classmethod
    def of(cls, test: torch.Tensor, ref: torch.Tensor) -> "DiffStats":
        check_pair(test, ref)
        return cls.from_sums(test.numel(), diff_sums(test[None], ref[None])[0].tolist())

    @classmethod
    def from_sums(cls, n: int, sums: list[float]) -> "DiffStats":
        """From the n elements' `diff_sums` (as Python floats)."""
        n_equal, *floats, max_ulp = sums
        return cls(n, int(n_equal), *floats, int(max_ulp))

    def merge(self, other: "DiffStats") -> "DiffStats":
        return DiffStats(
            n=self.n + other.n,
            n_equal=self.n_equal + other.n_equal,
            sum_abs=self.sum_abs + other.sum_abs,
            max_abs=max(self.max_abs, other.max_abs),
            sum_sq_diff=self.sum_sq_diff + other.sum_sq_diff,
            sum_sq_ref=self.sum_sq_ref + other.sum_sq_ref,
            sum_sq_test=self.sum_sq_test + other.sum_sq_test,
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
    def dot(self) -> float:
        """test·ref from ‖t‖² + ‖r‖² − ‖t−r‖² = 2 t·r. Each sum is within `_row_sums`' relative bound, and an
        error of that size in ‖t‖² or ‖r‖² moves the cosine only to second order, so 1 − cos stays accurate
        for nearly equal tensors (with t·r summed on its own, the sums' rounding would enter 1 − cos at first
        order)."""
        return (self.sum_sq_test + self.sum_sq_ref - self.sum_sq_diff) / 2

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
