"""The names of the rollout layouts: each RL framework's (adapters.py maps their fields) and the generic one.

Names alone, importing nothing, so that a spec choosing the layout a run writes (--rollouts-format) sits no deeper in
the import graph than its other fields.
"""

FRAMEWORKS = ("verl", "openrlhf", "slime", "trl")  # adapters.ADAPTERS, in this order
EXPORT_FORMATS = (*FRAMEWORKS, "generic")  # the layouts a generate-mode run writes its rollouts.jsonl in
