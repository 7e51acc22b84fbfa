"""Load prompts from files, tokenize each once, and check that each fits the model.

Both stacks score the same `token_ids`, so each prompt is tokenized once, here. Neither stack
tokenizes on its own, so the two can't disagree about BOS or whitespace.

    from divergence_probe.prompts import load_prompts
    prompts = load_prompts(None, tokenizer, num_prompts=8, max_model_len=4096)  # None: the sample prompts

Accepted inputs (`--prompts`):

- `name.txt`: plain text, one prompt per block. Blocks are separated by one or more blank lines
  (whitespace-only lines count as blank). Code has blank lines inside functions, so if the file
  has any line that is exactly `---` (trailing spaces ignored), the file is split ONLY on those
  lines and blank lines stay inside prompts. A `---` at the very start or end of the file is
  allowed. An empty block between two `---` lines is an error. Trailing whitespace is stripped
  from each prompt. Blank lines before a prompt are dropped. Indentation and interior newlines
  are kept.
- `name.jsonl`: one JSON object per non-empty line, either `{"prompt": "..."}` or
  `{"messages": [{"role": "...", "content": "..."}, ...]}`. Messages are rendered with the model's
  chat template (`add_generation_prompt=True`), and the rendered string is the prompt text.
  Other keys are ignored.
- a directory: every `*.txt` and `*.jsonl` file directly inside it, sorted by name. Other files,
  subfolders and hidden files (such as macOS `._name.txt`) are skipped.

Every prompt has a stable name, `source`: `"<file>:<index>"`. `<index>` counts prompts within the file
from 0, e.g. `code.txt:3`. Errors that come from parsing give the file and the 1-based line number.
"""

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

from divergence_probe.errors import PromptError
from divergence_probe.tokenized import Prompt

SUFFIXES = (".txt", ".jsonl")
ACCEPTED = ("a .txt file (prompts separated by blank lines or `---` lines), a .jsonl file "
            "(one {\"prompt\": ...} or {\"messages\": [...]} object per line), or a folder of them")
SEPARATOR = "---"
MAX_FILE_BYTES = 256 * 2**20  # a prompts file is read whole; a run scores thousands of prompts at most


@dataclass(frozen=True)
class PromptSource:
    """One prompt as written in a file, before tokenization. Exactly one of text/messages is set."""

    source: str                        # "code.txt:3": file relative to the prompts root, index in file
    text: str | None = None
    messages: list[dict] | None = None  # chat turns, rendered by the tokenizer's chat template
    line: int = 1                      # 1-based line where the prompt starts, for error messages

    @property
    def where(self) -> str:
        return f"{self.source} (line {self.line})"


# -----------------------------------------------------------------------------
# files

def default_prompts_path() -> Path:
    """The sample prompts, package data (data/sample_prompts/): an installed wheel has them as a checkout does, so
    the default works wherever the tool is installed and whatever the working directory."""
    path = Path(__file__).resolve().parent / "data" / "sample_prompts"
    if not path.is_dir():
        raise PromptError(f"No sample prompts found at {path} (the installed package is incomplete); reinstall "
                          f"divergence-probe, or pass --prompts with {ACCEPTED}.")
    return path


def check_kind(path: Path) -> None:
    """Refuse a prompts path that exists but is neither a regular file nor a folder: reading a FIFO or a device would
    block, or never end. Cheap, so the commands call it before anything loads."""
    path = Path(path)
    if path.exists() and not path.is_file() and not path.is_dir():
        raise PromptError(f"Prompts path {path} is not a regular file or folder (a FIFO, device or socket); pass "
                          f"--prompts with {ACCEPTED}.")


def _prompt_files(path: Path) -> list[tuple[str, Path]]:
    """(name relative to the prompts root, path) for every prompt file that `path` stands for."""
    path = Path(path)
    if not path.exists():
        raise PromptError(f"Prompts path {path} does not exist; pass --prompts with {ACCEPTED}.")
    if path.is_dir():
        files = sorted((p for p in path.iterdir()
                        if p.is_file() and p.suffix.lower() in SUFFIXES and not p.name.startswith(".")),
                       key=lambda p: p.name)
        if not files:
            raise PromptError(f"Folder {path} has no .txt or .jsonl prompt files; pass --prompts with {ACCEPTED}.")
        return [(p.name, p) for p in files]
    check_kind(path)
    if path.suffix.lower() not in SUFFIXES:
        raise PromptError(f"Prompts file {path} has an unsupported type {path.suffix or '(no suffix)'!r}; "
                          f"pass --prompts with {ACCEPTED}.")
    return [(path.name, path)]


def _read_bytes(path: Path) -> bytes:
    try:
        with path.open("rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise PromptError(f"Cannot read prompts file {path}: {e.strerror or e}. Check that it exists "
                          f"and is readable.") from e
    if len(data) > MAX_FILE_BYTES:
        raise PromptError(f"Prompts file {path} is over {MAX_FILE_BYTES // 2**20} MiB, the bound on a prompts file "
                          "(it is read whole); pass fewer prompts (split the file, or --num-prompts on a shorter one).")
    return data


def file_hashes(path: Path) -> dict[str, str]:
    """sha256 of every prompt file under `path`, keyed by relative name, so a run manifest pins its inputs."""
    return _read_sources(path)[1]


class Prompts(list):
    """The prompts load_prompts made, with `file_sha256`: the sha256 of the very bytes they were parsed from, keyed
    by file name, for the manifest (hashing the files again could pin a file replaced in between)."""

    def __init__(self, prompts, file_sha256: dict[str, str]) -> None:
        super().__init__(prompts)
        self.file_sha256 = file_sha256


# -----------------------------------------------------------------------------
# parsing (no tokenizer)

def _parse_txt(name: str, path: Path, text: str) -> list[PromptSource]:
    lines = text.split("\n")
    blocks: list[tuple[int, list[str]]] = []  # (1-based first line, lines)
    by_separator = any(line.rstrip() == SEPARATOR for line in lines)
    if by_separator:
        start, block = 1, []
        for lineno, line in enumerate(lines, start=1):
            if line.rstrip() == SEPARATOR:
                blocks.append((start, block))
                start, block = lineno + 1, []
            else:
                block.append(line)
        blocks.append((start, block))
    else:
        block = None
        for lineno, line in enumerate(lines, start=1):
            if not line.strip():
                block = None
            elif block is None:
                block = [line]
                blocks.append((lineno, block))
            else:
                block.append(line)

    out: list[PromptSource] = []
    for i, (start, block) in enumerate(blocks):
        separator_line = start - 1  # in `---` mode, the line that opened this block
        # drop leading blank lines but keep the first line's indentation (code prompts)
        while block and not block[0].strip():
            block, start = block[1:], start + 1
        body = "\n".join(block).rstrip()
        if not body:
            if i == 0 or i == len(blocks) - 1:
                continue  # a `---` at the start or end of the file
            raise PromptError(f"{path}:{separator_line}: empty prompt after this `---` line; remove the extra `---`.")
        out.append(PromptSource(f"{name}:{len(out)}", text=body, line=start))
    return out


def _parse_jsonl(name: str, path: Path, text: str) -> list[PromptSource]:
    out: list[PromptSource] = []
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptError(f"{where}: not valid JSON ({e.msg}, column {e.colno}); write one JSON object "
                              f"per line.") from e
        if not isinstance(obj, dict):
            raise PromptError(f"{where}: expected a JSON object with a \"prompt\" string or a \"messages\" "
                              f"list, got {type(obj).__name__}.")
        has_prompt, has_messages = "prompt" in obj, "messages" in obj
        if has_prompt == has_messages:
            raise PromptError(f"{where}: needs exactly one of \"prompt\" (a string) or \"messages\" "
                              f"(a list of {{role, content}}); found {'both' if has_prompt else 'neither'}.")
        source = f"{name}:{len(out)}"
        if has_prompt:
            if not isinstance(obj["prompt"], str):
                raise PromptError(f"{where}: \"prompt\" must be a string, got {type(obj['prompt']).__name__}.")
            out.append(PromptSource(source, text=obj["prompt"], line=lineno))
            continue
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages:
            raise PromptError(f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}} objects.")
        for j, m in enumerate(messages):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise PromptError(f"{where}: messages[{j}] must be an object with string \"role\" and "
                                  f"\"content\", got {json.dumps(m, ensure_ascii=False)[:80]}.")
        out.append(PromptSource(source, messages=messages, line=lineno))
    return out


def read_prompt_sources(path: Path) -> list[PromptSource]:
    """Parse every prompt file under `path` in a fixed order. Needs no tokenizer, so it is cheap to validate early."""
    return _read_sources(path)[0]


def _read_sources(path: Path) -> tuple[list[PromptSource], dict[str, str]]:
    """The prompts of every file under `path`, and each file's sha256, both of the one read of its bytes."""
    sources: list[PromptSource] = []
    hashes: dict[str, str] = {}
    for name, p in _prompt_files(path):
        data = _read_bytes(p)
        hashes[name] = hashlib.sha256(data).hexdigest()
        try:
            text = data.decode("utf-8-sig")  # -sig: tolerate a BOM from Windows editors
        except UnicodeDecodeError as e:
            raise PromptError(f"Prompts file {p} is not UTF-8 (byte {e.start}); re-save it as UTF-8.") from e
        text = text.replace("\r\n", "\n").replace("\r", "\n")
        parse = _parse_txt if p.suffix.lower() == ".txt" else _parse_jsonl
        sources += parse(name, p, text)
    return sources, hashes


# -----------------------------------------------------------------------------
# tokenization and length checks

def _render(src: PromptSource, tokenizer) -> tuple[str, bool]:
    """(prompt text, whether the tokenizer should add special tokens)."""
    if src.messages is None:
        return src.text, True
    if not getattr(tokenizer, "chat_template", None):
        raise PromptError(f"{src.where} is a chat prompt (\"messages\"), but the model has no chat template; "
                          f"write it as a plain {{\"prompt\": ...}} line instead.")
    from jinja2.exceptions import TemplateError  # transformers' own dependency for chat templates
    try:
        text = tokenizer.apply_chat_template(src.messages, tokenize=False, add_generation_prompt=True)
    except TemplateError as e:
        raise PromptError(f"{src.where}: the model's chat template rejected these messages: {e}") from e
    # the template already wrote BOS and friends; adding them again would double them
    return text, False


def load_prompts(path: Path | None, tokenizer, *, num_prompts: int | None = None,
                 max_prompt_tokens: int | None = None, max_model_len: int) -> Prompts:
    """Read, render and tokenize prompts, taking the first `num_prompts` in file order.

    Every prompt must have >= 2 tokens (each token after the first is scored) and must leave one
    position of `max_model_len` for the sampled token. With `max_prompt_tokens` long prompts are
    truncated to fit; without it they are an error, so a run never silently scores less than asked.
    """
    if num_prompts is not None and num_prompts < 1:
        raise PromptError(f"--num-prompts must be at least 1, got {num_prompts}.")
    limit = max_model_len - 1  # one position is needed for the sampled token
    if max_prompt_tokens is not None:
        if max_prompt_tokens < 2:
            raise PromptError(f"--max-prompt-tokens must be at least 2 (every token after the first is scored), "
                              f"got {max_prompt_tokens}.")
        if max_prompt_tokens > limit:
            raise PromptError(f"--max-prompt-tokens {max_prompt_tokens} does not fit the model's context of "
                              f"{max_model_len} tokens (one position is kept for the sampled token); "
                              f"use at most {limit}.")

    path = Path(path) if path is not None else default_prompts_path()
    sources, hashes = _read_sources(path)
    if num_prompts is not None:
        sources = sources[:num_prompts]

    prompts: list[Prompt] = []
    for src in sources:
        if src.text is not None and not src.text.strip():
            raise PromptError(f"{src.where} is empty; remove it or give it some text.")
        text, add_special = _render(src, tokenizer)
        ids = tuple(int(i) for i in tokenizer(text, add_special_tokens=add_special)["input_ids"])
        if len(ids) < 2:
            raise PromptError(f"{src.where} has {len(ids)} token(s); a prompt needs at least 2, because every "
                              f"token after the first is scored. Make it longer.")
        truncated = max_prompt_tokens is not None and len(ids) > max_prompt_tokens
        if truncated:
            ids = ids[:max_prompt_tokens]
        elif len(ids) > limit:
            raise PromptError(f"{src.where} has {len(ids)} tokens, but the model's context is {max_model_len} "
                              f"(one position is kept for the sampled token); pass --max-prompt-tokens {limit} "
                              f"to truncate it, or shorten the prompt.")
        prompts.append(Prompt(len(prompts), src.source, text, ids, truncated))

    if not prompts:
        raise PromptError(f"No prompts found in {path}; pass --prompts with {ACCEPTED}.")
    return Prompts(prompts, hashes)


def batches(prompts: Sequence[Prompt], max_tokens: int, max_count: int | None = None) -> Iterator[list[Prompt]]:
    """Consecutive groups whose total length fits max_tokens (a longer prompt goes alone), of at most max_count
    prompts (an engine schedules at most so many requests in one step)."""
    group, size = [], 0
    for prompt in prompts:
        if group and (size + len(prompt.token_ids) > max_tokens or len(group) == max_count):
            yield group
            group, size = [], 0
        group.append(prompt)
        size += len(prompt.token_ids)
    if group:
        yield group


def padded_batches(prompts: Sequence[Prompt], max_tokens: int) -> Iterator[list[Prompt]]:
    """Consecutive groups that fit max_tokens once right-padded to their longest prompt (rows x longest; a longer
    prompt goes alone): a trainer's micro-batches."""
    group, longest = [], 0
    for prompt in prompts:
        n = len(prompt.token_ids)
        if group and (len(group) + 1) * max(longest, n) > max_tokens:
            yield group
            group, longest = [], 0
        group.append(prompt)
        longest = max(longest, n)
    if group:
        yield group
