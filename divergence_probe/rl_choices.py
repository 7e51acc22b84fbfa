"""The rl command's named choices: the off-policy corrections its loss applies (rl/grpo.py) and the tasks its reward
knows by name (rl/reward.py). Its spec (spec/rl.py) checks a flag against them and the loop implements them; kept
free of imports so both read one list and neither imports the other for it.
"""

BUILT_IN_REWARDS = ("brackets", "letters")  # --reward's tasks by name (rl/reward.py BUILT_IN); anything else is code
CORRECTIONS = ("none", "tis", "mis")  # off-policy corrections of the engine/trainer mismatch (rl/grpo.py)
