"""Routing replay (R3, "rollout routing replay"): the trainer's mixture-of-experts layers send each token to the experts
the engine sent it to, for the same sequence.

Not a patch of one stack's numerics like the other regions: the trainer takes data from the engine's run of the same
sequences, so the run loop wires it (runs/route_capture.py keeps the engine's routes, engines/hf/trainer.py `routes_replayed` feeds
them to the trainer's router). As an ablation factor it answers the question the R3 paper asks: how much of the MoE
mismatch is routing, and how much rounding. `--routing-replay` picks what is replayed: the engine's ids with the
trainer's own gate weights for them (R3, what verl's router_replay and Megatron's RouterReplay do), or ids and the
engine's weights.
"""

from __future__ import annotations

from .base import Region

ROUTING = Region(
    name="routing",
    summary="routing replay (MoE): the trainer uses the engine's experts for every token and layer (R3; "
            "--routing-replay ids+weights: the engine's gate weights too)",
    from_engine=True,
    exists_in=lambda family: family.top_k_field is not None,  # a model with mixture-of-experts routers
)
