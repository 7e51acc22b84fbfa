"""The README's recipes as the suite runs them. Every `divergence-probe` command in a ```bash block of README.md (and
of docs/reference/recipes.md, its further recipes) is either run, on the built-in model (`--model M` left out, as
the README tells users to), or listed in NOT_RUN with why: a new recipe in the README needs a decision here
(tests/docs/test_readme.py checks that, and that every command parses and builds its run spec). NOT_RUN may name a
recipe the README does not have yet (one landing on another branch); RUN may not.

The runs share the built-in model's engine in the "builtin" process of conftest.cli_processes (it is started there
for the ablation anyway), so each costs its own scoring alone; SIZE keeps that to two short prompts on the CPU.
"""

from __future__ import annotations

import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GUIDES = (README, ROOT / "docs" / "reference" / "recipes.md")  # the recipes the README links, moved there as they were
SIZE = ["--device", "cpu", "--num-prompts", "2", "--max-prompt-tokens", "64"]
PLACEHOLDER = ["--model", "M"]

# run name in cli_processes["builtin"] -> (the README command, without --model M and --out; what the suite adds)
RUN = {
    "readme-normal": ("compare --batch-invariance", SIZE),
    "readme-where": ("compare --taps all", SIZE),
    "readme-where-local": ("compare --graft --depth", SIZE),
    "builtin-ablate": ("ablate --taps none", SIZE + ["--bootstrap", "0"]),  # 1000 draws: seconds we can save
}
# run in tests/docs/test_readme.py itself, on the folder the command before it wrote
RENDERED = {"report runs/where-local": "readme-where-local"}
NOT_RUN = {
    "remedies --num-prompts 40": "a compare with its floors per arm and a second engine for FP16: minutes on a CPU; "
    "test_remedies runs every arm a dense model has on the two-transformers probe",
    "ablate --taps none --regions lm_head --factor train:kernels=vllm": "four combinations with a second trainer; "
    "test_engine_knobs runs a region and a trainer-kernel factor on the built-in model",
    "compare --taps all --train-kernels vllm --batch-invariance": "test_train_kernels runs compare with the engine's "
    "kernels in the trainer and checks the first norm bitwise equal",
    "compare --engine compiled --engine-noise --taps none": "builds three engines (compiled with and without tap "
    "points, and eager): minutes on a CPU; test_engine_modes runs the compiled engine and its noise floor",
    "ablate --taps none --side train": "eight more combinations of the same ablation, the trainer alone aligned; "
    "test_toy_cli and test_ablation run --side train",
    "rl --setting none --setting rope,swiglu,rmsnorm --side train --seeds 2 --steps 20 --report": "four GRPO runs "
    "of 20 steps each; test_rl runs rl with a few steps",
    "score rollouts/step_120.parquet": "needs your run's rollout file; test_score scores rollouts the suite samples",
    "score rollouts/step_120.jsonl.gz --infer vllm --temperature 0.7": "needs your run's rollout file; test_score "
    "runs --infer vllm on rollouts the suite samples",
    "compare --taps all --batch-invariance": "the MoE recipe: M is a Qwen3-MoE (make-model models/moe); "
    "test_moe_compare and test_moe_routing run it on the tiny one",
    "compare --taps all --align routing": "the MoE recipe: needs a Qwen3-MoE for M; test_moe_routing replays routes",
    "ablate --regions rope,rmsnorm,routing": "the MoE recipe: needs a Qwen3-MoE for M; test_moe_routing ablates "
    "routing",
    "compare": "one process per GPU (CUDA_VISIBLE_DEVICES=0); on the CPU it is the first recipe without its floor",
    "compare --align rope": "one process per GPU (CUDA_VISIBLE_DEVICES=1); test_compare aligns rope",
    """compare --engine-args '{"tensor_parallel_size": 2}' --engine-noise""": "two engines (TP 2 and its TP 1 floor) "
    "over two devices; test_tensor_parallel runs TP 2 on the CPU",
    "score rollouts/": "needs your run's rollout files; test_history scores a many-step folder in each layout",
    "score 'rollouts/step_*.parquet' --fields infer=rollout_lp,train=actor_lp --alarm 'k3>5e-4'": "needs your run's "
    "rollout files; test_history names both columns with --fields and sets an alarm",
    "compare --prompts ci/prompts.txt --taps none --batch-invariance --fail-if 'mismatch_over_floor>2' --fail-if "
    "'mean_kl>1e-3'": "needs your CI's pinned prompts; test_gate runs --fail-if on toy stacks, failing and passing",
    "diff runs/ci-last-good 'runs/ci-$GIT_SHA'": "needs two run folders of your CI; test_diff diffs two toy runs",
}


def readme_commands() -> list[tuple[str, list[str]]]:
    """(page:line, words after `divergence-probe`) of every divergence-probe command in a ```bash block of the
    GUIDES, with an environment prefix and a trailing `&` dropped."""
    found = []
    for page in GUIDES:
        in_block = False
        for number, line in enumerate(page.read_text().splitlines(), 1):
            if line.startswith("```"):
                in_block = line.strip() == "```bash" and not in_block
                continue
            if in_block and "divergence-probe " in line:
                words = shlex.split(line.split("#")[0].rstrip().removesuffix("&"))
                found.append((f"{page.relative_to(ROOT)}:{number}", words[words.index("divergence-probe") + 1:]))
    return found


def key(words: list[str]) -> str:
    """A command as RUN and NOT_RUN name it: --model M and --out DIR left out."""
    words = list(words)
    for flag in ("--model", "--out"):
        if flag in words:
            at = words.index(flag)
            del words[at:at + 2]
    return shlex.join(words)


def builtin_commands() -> dict[str, list[str]]:
    """The README commands the "builtin" process runs, by run name, as it runs them (without --out); that each is a
    README command is tests/docs/test_readme.py's check."""
    return {name: shlex.split(command) + extra for name, (command, extra) in RUN.items()}
