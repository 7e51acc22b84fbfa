"""The rl command's trainer: FP32 master weights with AdamW, a BF16 compute model for forward and backward.

Why this split (what RL trainers do, e.g. Megatron's and FSDP's mixed precision): an AdamW step moves a weight by about
lr, and a BF16 weight cannot move by less than half its unit in the last place (|w|·2^-9), so updates made on BF16
weights round away whenever lr is small against |w|; FP32 masters accumulate them. The forward and backward run on the
BF16 copy, as trainers do and as the mismatch study needs: the trainer's logprobs come from the same BF16 weights the
engine receives, so the weights are identical on both sides and the only difference left is how each stack computes.
After each optimizer step the masters are rounded (to nearest even) into the compute model, whose tensors are pushed.

The compute model is the training stack's transformers model (engines/hf/trainer.py), run under the trainer's torch numerics;
regions are aligned on it with `align.apply`, exactly as a user's trainer would. Under --train-precision amp that
model holds the weights in FP32 and runs under torch.autocast to BF16 (engines/hf/trainer.py): its GEMMs see the masters rounded
to BF16, which is what the engine receives (`named_weights`), so the weights are identical on both sides there too.
"""

from __future__ import annotations

import weakref

import torch

from ..errors import NumericsError


# The checkpoint of each loaded training stack, for resets between runs: taken by its first trainer, so that a later
# trainer on the same stack (whose model an earlier run trained) starts from the checkpoint too. Kept by rl, not on the
# stack; dropped with the stack.
_CHECKPOINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class Trainer:
    def __init__(self, stack, lr: float, grad_clip: float, weight_decay: float = 0.0) -> None:
        self.stack = stack  # a loaded protocol.Trainer (HFStack): stack.model is the BF16 compute model
        self.model = stack.model
        self.names = [n for n, _ in self.model.named_parameters()]
        self.params = [p for _, p in self.model.named_parameters()]
        for p in self.params:
            p.requires_grad_(True)
        if stack not in _CHECKPOINTS:  # the first trainer on this loaded stack: its weights are the checkpoint's
            _CHECKPOINTS[stack] = [p.detach().clone() for p in self.params]
        self.initial = _CHECKPOINTS[stack]
        self.lr, self.grad_clip, self.weight_decay = lr, grad_clip, weight_decay
        self.reset()

    def reset(self) -> None:
        """Back to the checkpoint's weights, with new FP32 masters and a fresh optimizer."""
        with torch.no_grad():
            for p, w in zip(self.params, self.initial):
                p.copy_(w)
        self.master = [w.float().clone().requires_grad_(True) for w in self.initial]
        self.optimizer = torch.optim.AdamW(self.master, lr=self.lr, betas=(0.9, 0.95), eps=1e-8,
                                           weight_decay=self.weight_decay)

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The compute model's weights by checkpoint name, in the run's dtype: what is pushed into the engine (under
        AMP the FP32 weights rounded to nearest even, the values autocast computes with; else the model's own)."""
        dtype = self.stack.settings.dtype
        return {n: p.detach().to(dtype) for n, p in zip(self.names, self.params)}

    def forward(self, sequences: list[tuple[int, ...]], n_prompt: list[int], routes: list[torch.Tensor] | None = None,
                replay: bool = False):
        """One right-padded batch: returns (logprobs [B, L-1] FP32 with grad, entropy [B, L-1], response mask [B, L-1],
        routing). Position j scores token j+1; the mask is 1 where that token is a response token.

        A mixture of experts: `routes` holds the engine's experts of each sequence's fed rows ([len-1, layers, k]);
        `replay` sends every such row to them (R3: the engine's ids, the trainer's own gate weights, HFStack's
        routes_replayed). routing: (the trainer's router's own choice, the engine's), each [layers, B, L, k], -1 where
        the engine ran no row; None without routes."""
        device = self.params[0].device
        longest = max(len(s) for s in sequences)
        pad = self.model.generation_config.pad_token_id or 0
        ids = torch.full((len(sequences), longest), pad, device=device)
        attention = torch.zeros_like(ids)
        mask = torch.zeros(len(sequences), longest - 1, device=device)
        for row, (seq, n) in enumerate(zip(sequences, n_prompt)):
            ids[row, : len(seq)] = torch.tensor(seq)
            attention[row, : len(seq)] = 1
            mask[row, n - 1 : len(seq) - 1] = 1
        positions = torch.arange(longest, device=device)[None].expand_as(ids)
        own: dict[int, torch.Tensor] = {}
        # on the device once, not per layer in the replay's hook
        engine = _batch_routes(routes, len(sequences), longest).to(device) if routes is not None else None
        # the router's own choice ([B * L, k]); installed before the forward's replay, so it sees the router's own pick
        with self.stack.capture(frozenset({"expert_ids"}) if routes is not None else frozenset(),
                                lambda key, x: own.__setitem__(key.layer, x.detach())):
            logits = self.stack.forward(ids, attention, positions,
                                        routes=(lambda _, layer: (engine[layer], None)) if replay else None)
        logp = logits[:, :-1].float().log_softmax(dim=-1)  # as trainers do: log_softmax of the FP32-upcast logits
        chosen = logp.gather(-1, ids[:, 1:, None])[..., 0]
        with torch.no_grad():
            entropy = -(logp.exp() * logp).sum(-1)
        routing = None
        if engine is not None:
            shape = (len(own), len(sequences), longest, -1)
            routing = (torch.stack([own[i] for i in sorted(own)]).view(shape), engine.reshape(shape))
        return chosen, entropy, mask, routing

    def step(self, loss: torch.Tensor) -> float:
        """Backward through the BF16 model, the update on the FP32 masters, then round them into the model.
        Returns the gradient norm before clipping."""
        for p in self.params:
            p.grad = None
        with self.stack.numerics("train") as observed, observed(autocast=False):  # the forward was autocast; not this
            loss.backward()
        for m, p in zip(self.master, self.params):
            m.grad = p.grad.float() if p.grad is not None else torch.zeros_like(m)
        norm = torch.nn.utils.clip_grad_norm_(self.master, self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._check_finite(float(norm))
        with torch.no_grad():
            for m, p in zip(self.master, self.params):
                p.copy_(m)  # FP32 -> BF16, round to nearest even
                p.grad = None
        return float(norm)


    def _check_finite(self, norm: float) -> None:
        """NumericsError when the update just made a master weight NaN or inf: the step is what broke them (an
        overflowing learning rate, a non-finite gradient), and the push that follows would carry them into the engine
        and be blamed for what it faithfully copied."""
        finite = torch.stack([torch.isfinite(m).all() for m in self.master]).tolist()  # one device sync
        if all(finite):
            return
        broken = [n for n, ok in zip(self.names, finite) if not ok]
        raise NumericsError(f"the optimizer step made {len(broken)} of {len(self.names)} trainer weights NaN or inf "
                            f"(first: {broken[0]}; learning rate {self.lr:g}, gradient norm {norm:.3g} before "
                            "clipping): the update, not the weight push, broke them; lower --lr or --grad-clip")


def _batch_routes(routes: list[torch.Tensor], batch: int, longest: int) -> torch.Tensor:
    """Each sequence's routes ([fed rows, layers, k]) laid out as the right-padded batch's flattened rows:
    [layers, batch * longest, k], -1 where the engine ran no row (a sequence's last token, padding)."""
    layers, k = routes[0].shape[1:]
    out = torch.full((batch, longest, layers, k), -1, dtype=torch.long)
    for row, r in enumerate(routes):
        out[row, : len(r)] = r.long().cpu()
    return out.view(batch * longest, layers, k).permute(1, 0, 2)
