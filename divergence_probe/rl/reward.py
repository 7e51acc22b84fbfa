"""The rl command's verifiable task (close every bracket), its prompts, and the `--reward module:function` plug-in.

The task: each prompt is the start of a line of Python that leaves brackets open (`(`, `[`, `{`); a response
earns 1 when the prompt plus the response, read as text, closes every bracket it opened, in order, and leaves
none open; 0 otherwise (a wrong closer, e.g. `)` for `[`, is 0 too). Why this task:
- verifiable by a few lines of code, with no judgement: string literals are not parsed, so a bracket inside a
  string counts like any other (the rule is the rule; the model can learn it);
- learnable by the built-in model: it was trained on the standard library's sources, so it closes brackets
  often but not reliably (it keeps writing past the line, opens new ones, or stops early), and every response
  is a chance to be right; the group of G responses per prompt usually holds both outcomes, which is what
  GRPO's group-normalised advantage needs to produce a gradient;
- not trivially saturated: the prompts nest one to three levels deep, and a response of `--max-new-tokens`
  tokens that rambles on opens brackets it has no room to close.

A second built-in task, `--reward letters`, is dense: the share of the response's characters that are lowercase
ASCII letters. The bracket task gives no signal on weights that never close a bracket (a random checkpoint of a
real shape scores 0 in every group, so nothing learns). A random policy's samples mix letters with spaces,
punctuation, digits and other scripts, so the share sits well inside (0, 1) and differs between the samples of a
group: GRPO has an advantage to follow from the first step, and the policy climbs by sampling letter-only tokens
more often, at any shape and from any weights. (A rarer class, digits, was tried first: on the tiny random
checkpoint most samples hold none, and the reward did not rise reliably in 16 steps.) It is verifiable by one line,
and what it rewards does not matter here: the loop's numerics are under study, not the task.

A user's reward is `--reward package.module:function`, called as `function(prompt_text, response_text) -> float`
for each response (importable from the current folder or PYTHONPATH).
"""

from __future__ import annotations

import importlib
import math
import sys
from pathlib import Path
from typing import Callable

from ..errors import ProbeError, one_line
from ..signals import Stopped
from ..rl_choices import BUILT_IN_REWARDS

Reward = Callable[[str, str], float]

PAIRS = {")": "(", "]": "[", "}": "{"}

# Python line starts that leave 1-3 brackets open; the model continues them.
PROMPTS = (
    "result = compute(values[0], ",
    "print(sorted(items, key=lambda x: (x[1], ",
    "data = {'name': [1, 2, ",
    "if isinstance(obj, (list, ",
    "return self._cache.get(key, default",
    "total = sum(len(line) for line in lines[",
    "parser.add_argument('--path', type=str, help=(",
    "matrix = [[0] * width for _ in range(",
    "os.path.join(os.path.dirname(__file__), ",
    "self.assertEqual(func(args[1:], ",
    "raise ValueError('bad value: %r' % (value",
    "for key, value in sorted(mapping.items(",
    "names = [name.strip() for name in text.split(",
    "yield from self._walk(node.children[",
    "logger.info('loaded %d items from %s', len(items",
    "config = dict(zip(keys, map(int, ",
)


class RewardError(ProbeError):
    """The --reward plug-in cannot be imported or does not return a number."""


def closes_brackets(prompt: str, response: str) -> float:
    """1.0 when prompt + response closes every bracket it opens, in order, leaving none open; else 0.0."""
    stack: list[str] = []
    for ch in prompt + response:
        if ch in "([{":
            stack.append(ch)
        elif ch in PAIRS:
            if not stack or stack.pop() != PAIRS[ch]:
                return 0.0
    return 0.0 if stack else 1.0


def letter_share(prompt: str, response: str) -> float:
    """The share of the response's characters that are lowercase ASCII letters (0.0 for an empty response)."""
    return sum("a" <= ch <= "z" for ch in response) / len(response) if response else 0.0


BUILT_IN: dict[str, Reward] = dict(zip(BUILT_IN_REWARDS, (closes_brackets, letter_share)))


def load_reward(spec: str | None) -> Reward:
    """The built-in bracket task's reward for None, a built-in task by name (BUILT_IN), else the function that
    `module:function` names."""
    if spec is None:
        return closes_brackets
    if spec in BUILT_IN:
        return BUILT_IN[spec]
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise RewardError(f"--reward {spec!r} is not module:function; pass e.g. --reward my_rewards:score")
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # a reward module next to the user, as `python -m` would find it
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        missing = getattr(e, "name", None)
        if missing and not (module_name == missing or module_name.startswith(f"{missing}.")):
            raise RewardError(f"--reward {spec}: importing {module_name} failed: {_describe(e)}; install what it "
                              "imports, or fix the module") from e
        raise RewardError(f"--reward {spec}: cannot import {module_name} ({one_line(e)}); put it on PYTHONPATH or in "
                          "the current folder") from e
    except Stopped:
        raise
    except BaseException as e:  # the module's own code failed (SyntaxError, an exception, sys.exit at import)
        raise RewardError(f"--reward {spec}: importing {module_name} failed: {_describe(e)}; fix the module") from e
    fn = getattr(module, attr, None)
    if fn is None:
        raise RewardError(f"--reward {spec}: {module_name} has no function {attr}; name a function that takes "
                          "(prompt_text, response_text) and returns a number")
    if not callable(fn):
        raise RewardError(f"--reward {spec}: {module_name}.{attr} is a {type(fn).__name__}, not a function; name a "
                          "function that takes (prompt_text, response_text) and returns a number")
    return fn


def _describe(e: BaseException) -> str:
    """An exception as one line: its type and message; sys.exit(n) reads as what it is."""
    if isinstance(e, SystemExit):
        return f"it called sys.exit({e.code!r})"
    if isinstance(e, SyntaxError):
        return f"SyntaxError at {Path(e.filename or '?').name} line {e.lineno}: {e.msg}"
    text = one_line(e, 300)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def score(reward: Reward, prompt: str, response: str) -> float:
    """reward(prompt, response) as a float; anything else is the plug-in's error, named in one line."""
    name = getattr(reward, "__qualname__", repr(reward))
    try:
        value = reward(prompt, response)
    except Stopped:  # a signal, not the plug-in: the command stops as it does anywhere
        raise
    except BaseException as e:  # the plug-in's own bug, or its sys.exit: one line, not a traceback or a silent exit 0
        raise RewardError(f"the reward function {name} failed: {_describe(e)}; fix the plug-in") from e
    if isinstance(value, (str, bytes)):  # float("1") would take a string; a reward returns a number
        raise RewardError(f"the reward function {name} returned {one_line(repr(value), 80)}, not a number; return a "
                          "float")
    try:
        number = float(value)
    except Stopped:
        raise
    except BaseException:  # a list, a longer array, an object whose __float__ fails
        raise RewardError(f"the reward function {name} returned {one_line(repr(value), 80)}, not a number; return "
                          "one float per response") from None
    if not math.isfinite(number):  # NaN advantages would silently corrupt every later update
        raise RewardError(f"the reward function {name} returned {number}; return a finite number")
    return number
