"""GRPO's objective: group-normalised advantages and the PPO-clip loss with its ratio against the engine's logprobs.

The ratio is taken against the logprobs the inference engine reported for the tokens it sampled, as RL frameworks
that do not recompute an "old" policy on the trainer do: ρ = π_train/π_infer, so every numerical difference
between the engine and the trainer enters the update as off-policyness. With one update per rollout batch
(this loop), π_train at the update equals the trainer's view of the behaviour policy.

Corrections (Yao et al., "Your efficient RL framework secretly brings you off-policy RL training", 2025):
split ρ = (π_θ/π_θ,old) · (π_θ,old/π_infer). The first factor is the trainer's own PPO ratio (value 1 at the
single update, carrying the gradient); the second, detached, is the engine/trainer mismatch w:
- `tis`: multiply each token's clipped objective by min(w, C) (truncated importance sampling);
- `mis`: keep w but drop (mask) tokens whose w lies outside [1/C, C] (masked importance sampling);
- `none`: the ratio against the engine as it is, clipped to [1-ε, 1+ε] like any PPO ratio.
The loss is the mean over all response tokens of the batch (token-level, as DAPO and most current recipes).
"""

from __future__ import annotations

import torch

from ..rl_choices import CORRECTIONS


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """[P*G] rewards, G consecutive per prompt -> (r - mean of its group) / (std of its group + eps).

    A group whose G rewards are equal carries no signal: its advantages are exactly 0."""
    groups = rewards.float().view(-1, group_size)  # [P, G]
    mean = groups.mean(dim=1, keepdim=True)
    std = groups.std(dim=1, keepdim=True, unbiased=False)
    return ((groups - mean) / (std + eps)).view(-1)


def policy_loss(lp_train: torch.Tensor, lp_infer: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                clip_eps: float, correction: str = "none", cap: float = 2.0) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip loss. lp_train [B, T] (with grad), lp_infer [B, T] (the engine's), advantages [B], mask [B, T]
    (1 on response tokens). Returns the loss and what the step reports (the clipped and corrected fractions)."""
    mask = mask.float()
    adv = advantages[:, None].to(lp_train.dtype)
    if correction == "none":
        ratio = torch.exp(lp_train - lp_infer)
        weight = torch.ones_like(ratio)
    else:
        ratio = torch.exp(lp_train - lp_train.detach())  # π_θ/π_θ,old: 1 in value, the gradient of log π_θ
        w = torch.exp(lp_train.detach() - lp_infer)  # π_θ,old/π_infer: the mismatch, no gradient
        if correction == "tis":
            weight = w.clamp(max=cap)
        elif correction == "mis":
            weight = torch.where((w >= 1 / cap) & (w <= cap), w, torch.zeros_like(w))
        else:
            raise ValueError(f"unknown correction {correction!r}; choose one of {CORRECTIONS}")
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv
    objective = torch.minimum(unclipped, clipped) * weight
    n = mask.sum().clamp(min=1)
    loss = -(objective * mask).sum() / n
    with torch.no_grad():
        was_clipped = ((unclipped != clipped) & (clipped < unclipped)).float()
        stats = {"loss_clip_frac": float((was_clipped * mask).sum() / n),
                 "correction_weight_mean": float((weight * mask).sum() / n),
                 "correction_zeroed_frac": float(((weight == 0).float() * mask).sum() / n)}
    return loss, stats
