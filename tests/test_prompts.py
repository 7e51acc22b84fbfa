"""Prompt files -> tokenized prompts: each format, each error, and the shipped sample prompts.

The tokenizers are tiny byte-level BPEs built in memory, so these tests need no downloads.
"""

import hashlib
import json
from collections import Counter
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from divergence_probe import prompts as prompts_mod
from divergence_probe.errors import PromptError
from divergence_probe.prompts import (
    Prompt, PromptSource, default_prompts_path, file_hashes, load_prompts, read_prompt_sources,
)

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
BIG = 1_000_000  # a max_model_len that nothing in these tests reaches


def make_tokenizer(*, chat_template: str | None, bos: bool) -> PreTrainedTokenizerFast:
    """Byte-level BPE (any UTF-8 text encodes) with a few merges; optionally prepends <|bos|>."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
        special_tokens=["<|bos|>", "<|im_start|>", "<|im_end|>"])
    tok.train_from_iterator(["def forward(self, x): return x", "the quick brown fox", "hello world"] * 4, trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<|bos|> $A", special_tokens=[("<|bos|>", tok.token_to_id("<|bos|>"))])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|im_end|>")
    hf.chat_template = chat_template
    return hf


@pytest.fixture(scope="module")
def chat_tok():
    return make_tokenizer(chat_template=CHATML, bos=True)


@pytest.fixture(scope="module")
def plain_tok():
    return make_tokenizer(chat_template=None, bos=False)


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def jsonl(*rows) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n" for r in rows)


def texts(path: Path) -> list[str]:
    return [s.text for s in read_prompt_sources(path)]


# -----------------------------------------------------------------------------
# .txt

def test_txt_blank_lines_separate_prompts(tmp_path):
    f = write(tmp_path / "p.txt", "first line\n  indented second   \n\n \t \n\n\nsecond prompt  \n\n")
    sources = read_prompt_sources(f)
    assert [s.text for s in sources] == ["first line\n  indented second", "second prompt"]
    assert [s.source for s in sources] == ["p.txt:0", "p.txt:1"]
    assert [s.line for s in sources] == [1, 7]


def test_txt_keeps_leading_indentation(tmp_path):
    f = write(tmp_path / "p.txt", "    return x\n")
    assert texts(f) == ["    return x"]


def test_txt_separator_splits_only_on_dashes(tmp_path):
    code = "def f():\n    a = 1\n\n    return a"
    f = write(tmp_path / "code.txt", f"---\n{code}\n\n---  \n\nfn main() {{}}\n\n\nlet x = 1;\n---\n")
    sources = read_prompt_sources(f)
    assert [s.text for s in sources] == [code, "fn main() {}\n\n\nlet x = 1;"]
    assert [s.line for s in sources] == [2, 9]


def test_txt_dashes_inside_a_line_are_not_separators(tmp_path):
    f = write(tmp_path / "p.txt", "a --- b\n\n ---\n")  # indented `---` is text, so blank lines split
    assert texts(f) == ["a --- b", " ---"]


def test_txt_empty_block_between_separators_names_line(tmp_path):
    f = write(tmp_path / "p.txt", "one\n---\n  \n---\ntwo\n")
    with pytest.raises(PromptError, match=rf"p\.txt:2: empty prompt"):
        read_prompt_sources(f)


def test_txt_crlf_and_bom(tmp_path):
    f = tmp_path / "p.txt"
    f.write_bytes("\ufeffone\r\n\r\ntwo\r\n".encode("utf-8"))
    assert texts(f) == ["one", "two"]


# -----------------------------------------------------------------------------
# .jsonl

def test_jsonl_prompts_and_messages(tmp_path):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    f = write(tmp_path / "c.jsonl", jsonl({"prompt": "hello world", "id": 7}, "", "  ", {"messages": msgs}))
    sources = read_prompt_sources(f)
    assert sources == [PromptSource("c.jsonl:0", text="hello world", line=1),
                       PromptSource("c.jsonl:1", messages=msgs, line=4)]


def test_chat_template_applied(tmp_path, chat_tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    f = write(tmp_path / "c.jsonl", jsonl({"prompt": "hello world"}, {"messages": msgs}))
    plain, chat = load_prompts(f, chat_tok, max_model_len=BIG)
    bos = chat_tok.convert_tokens_to_ids("<|bos|>")

    assert plain.text == "hello world"
    assert plain.token_ids[0] == bos  # add_special_tokens=True for plain text
    assert chat.text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n" \
                        "<|im_start|>assistant\n"
    assert chat.text == chat_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    # the template wrote the special tokens itself; the tokenizer must not add a BOS on top
    assert chat.token_ids == tuple(chat_tok(chat.text, add_special_tokens=False)["input_ids"])
    assert chat.token_ids[0] == chat_tok.convert_tokens_to_ids("<|im_start|>")
    assert bos not in chat.token_ids


def test_chat_without_template_names_file_and_line(tmp_path, plain_tok):
    f = write(tmp_path / "c.jsonl", jsonl({"prompt": "ok ok"}, {"messages": [{"role": "user", "content": "Hi"}]}))
    with pytest.raises(PromptError, match=r"c\.jsonl:1 \(line 2\).*no chat template.*\"prompt\""):
        load_prompts(f, plain_tok, max_model_len=BIG)


def test_chat_template_error_becomes_prompt_error(tmp_path):
    tok = make_tokenizer(chat_template="{{ raise_exception('System role not supported') }}", bos=False)
    f = write(tmp_path / "c.jsonl", jsonl({"messages": [{"role": "system", "content": "x"}]}))
    with pytest.raises(PromptError, match=r"c\.jsonl:0 \(line 1\).*System role not supported"):
        load_prompts(f, tok, max_model_len=BIG)


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "a",}', r"not valid JSON"),
    ('["a list"]', r"expected a JSON object"),
    ('{"text": "a"}', r"found neither"),
    ('{"prompt": "a", "messages": []}', r"found both"),
    ('{"prompt": 3}', r"\"prompt\" must be a string"),
    ('{"messages": []}', r"non-empty list"),
    ('{"messages": "hi"}', r"non-empty list"),
    ('{"messages": [{"role": "user"}]}', r"messages\[0\] must be an object"),
])
def test_jsonl_errors_name_file_and_line(tmp_path, line, message):
    f = write(tmp_path / "bad.jsonl", jsonl({"prompt": "fine"}, "", line))
    with pytest.raises(PromptError, match=rf"bad\.jsonl:3: .*{message}"):
        read_prompt_sources(f)


# -----------------------------------------------------------------------------
# directories and paths

def test_directory_sorted_and_filtered(tmp_path, chat_tok):
    write(tmp_path / "b.txt", "bee one\n\nbee two\n")
    write(tmp_path / "a.jsonl", jsonl({"prompt": "ay one"}))
    write(tmp_path / "C.txt", "see one\n")  # uppercase sorts first by code point
    write(tmp_path / "notes.md", "# not a prompt\n")
    write(tmp_path / "._b.txt", "macOS metadata\n")
    write(tmp_path / "sub" / "nested.txt", "not read: folders are not searched\n")
    prompts = load_prompts(tmp_path, chat_tok, max_model_len=BIG)
    assert [p.source for p in prompts] == ["C.txt:0", "a.jsonl:0", "b.txt:0", "b.txt:1"]
    assert [p.text for p in prompts] == ["see one", "ay one", "bee one", "bee two"]
    assert [p.prompt_id for p in prompts] == [0, 1, 2, 3]
    assert all(isinstance(p, Prompt) and not p.truncated for p in prompts)


def test_directory_without_prompt_files(tmp_path):
    write(tmp_path / "readme.md", "hi\n")
    with pytest.raises(PromptError, match=r"no \.txt or \.jsonl prompt files"):
        read_prompt_sources(tmp_path)


def test_missing_path(tmp_path):
    with pytest.raises(PromptError, match=r"nope\.txt does not exist.*--prompts"):
        read_prompt_sources(tmp_path / "nope.txt")


def test_unsupported_suffix(tmp_path):
    f = write(tmp_path / "prompts.csv", "a,b\n")
    with pytest.raises(PromptError, match=r"prompts\.csv has an unsupported type '\.csv'.*\.jsonl"):
        read_prompt_sources(f)


def test_unreadable_file(tmp_path, monkeypatch):
    f = write(tmp_path / "p.txt", "hi\n")

    def deny(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(Path, "open", deny)  # chmod does not stop root, which CI often is
    with pytest.raises(PromptError, match=r"Cannot read prompts file .*p\.txt: Permission denied"):
        read_prompt_sources(f)


def test_not_utf8(tmp_path):
    f = tmp_path / "p.txt"
    f.write_bytes(b"caf\xe9\n")
    with pytest.raises(PromptError, match=r"p\.txt is not UTF-8"):
        read_prompt_sources(f)


def test_default_prompts_path():
    path = default_prompts_path()
    assert path == Path(__file__).resolve().parents[1] / "divergence_probe" / "data" / "sample_prompts"


def test_sample_prompts_at_the_repository_root_are_the_package_data():
    """The model card, pages and benchmarks cite `sample_prompts/` from the repository root: that path is the one
    copy, the package's folder, so it reads as the default prompts (and `--prompts sample_prompts` works there)."""
    top = Path(__file__).resolve().parents[1] / "sample_prompts"
    assert top.is_symlink() and top.resolve() == default_prompts_path()
    assert read_prompt_sources(top) == read_prompt_sources(default_prompts_path())


def test_default_prompts_are_package_data():
    """A wheel or `pip install .` carries the default prompts: every file of the folder is matched by the package-data
    globs of pyproject.toml (as setuptools globs them: `*` stops at a folder)."""
    import tomllib

    package = Path(prompts_mod.__file__).resolve().parent
    pyproject = tomllib.loads((package.parent / "pyproject.toml").read_text())
    shipped = {p for pattern in pyproject["tool"]["setuptools"]["package-data"]["divergence_probe"]
               for p in package.glob(pattern) if p.is_file()}
    prompts = {p for p in default_prompts_path().iterdir() if p.is_file()}
    assert prompts and prompts <= shipped, sorted(p.name for p in prompts - shipped)


def test_default_prompts_path_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(prompts_mod, "__file__", str(tmp_path / "pkg" / "prompts.py"))
    with pytest.raises(PromptError, match=r"--prompts"):
        default_prompts_path()


# -----------------------------------------------------------------------------
# tokenization and lengths

def test_empty_prompt_names_source(tmp_path, chat_tok):
    f = write(tmp_path / "p.jsonl", jsonl({"prompt": "fine"}, {"prompt": " \n "}))
    with pytest.raises(PromptError, match=r"p\.jsonl:1 \(line 2\) is empty"):
        load_prompts(f, chat_tok, max_model_len=BIG)


def test_single_token_prompt_is_too_short(tmp_path, plain_tok):
    f = write(tmp_path / "p.txt", "hello world\n\nx\n")
    with pytest.raises(PromptError, match=r"p\.txt:1 \(line 3\) has 1 token\(s\); a prompt needs at least 2"):
        load_prompts(f, plain_tok, max_model_len=BIG)


def test_too_long_without_truncation(tmp_path, plain_tok):
    f = write(tmp_path / "p.txt", "short one\n\n" + "abc " * 50 + "\n")
    n = len(plain_tok(("abc " * 50).rstrip())["input_ids"])
    message = rf"p\.txt:1 \(line 3\) has {n} tokens.*context is 20.*--max-prompt-tokens 19"
    with pytest.raises(PromptError, match=message):
        load_prompts(f, plain_tok, max_model_len=20)


def test_length_limit_leaves_one_position(tmp_path, plain_tok):
    text = "abcdefgh"
    n = len(plain_tok(text)["input_ids"])
    f = write(tmp_path / "p.txt", text + "\n")
    assert len(load_prompts(f, plain_tok, max_model_len=n + 1)[0].token_ids) == n
    with pytest.raises(PromptError, match=r"--max-prompt-tokens"):
        load_prompts(f, plain_tok, max_model_len=n)


def test_truncation(tmp_path, chat_tok):
    long_text = "the quick brown fox jumps over the lazy dog " * 5
    f = write(tmp_path / "p.txt", f"{long_text}\n\nhello world\n")
    full = tuple(chat_tok(long_text.rstrip())["input_ids"])
    long, short = load_prompts(f, chat_tok, max_prompt_tokens=10, max_model_len=20)
    assert long.token_ids == full[:10] and long.truncated
    assert long.text == long_text.rstrip()  # text stays as given; only the ids are cut
    assert not short.truncated and len(short.token_ids) < 10


@pytest.mark.parametrize("max_prompt_tokens, message", [(20, r"use at most 19"), (1, r"at least 2")])
def test_bad_max_prompt_tokens(tmp_path, chat_tok, max_prompt_tokens, message):
    f = write(tmp_path / "p.txt", "hello world\n")
    with pytest.raises(PromptError, match=message):
        load_prompts(f, chat_tok, max_prompt_tokens=max_prompt_tokens, max_model_len=20)


def test_num_prompts_takes_first_n(tmp_path, chat_tok):
    write(tmp_path / "a.txt", "one one\n\ntwo two\n")
    write(tmp_path / "b.txt", "three three\n")
    prompts = load_prompts(tmp_path, chat_tok, num_prompts=2, max_model_len=BIG)
    assert [p.source for p in prompts] == ["a.txt:0", "a.txt:1"]
    assert len(load_prompts(tmp_path, chat_tok, num_prompts=99, max_model_len=BIG)) == 3
    with pytest.raises(PromptError, match=r"--num-prompts must be at least 1"):
        load_prompts(tmp_path, chat_tok, num_prompts=0, max_model_len=BIG)


def test_zero_prompts(tmp_path, chat_tok):
    f = write(tmp_path / "p.txt", "\n  \n")
    with pytest.raises(PromptError, match=r"No prompts found in .*p\.txt"):
        load_prompts(f, chat_tok, max_model_len=BIG)


# -----------------------------------------------------------------------------
# hashes

def test_file_hashes(tmp_path):
    a = write(tmp_path / "a.txt", "alpha\n")
    write(tmp_path / "b.jsonl", jsonl({"prompt": "beta"}))
    write(tmp_path / "skip.md", "ignored\n")
    hashes = file_hashes(tmp_path)
    assert hashes == file_hashes(tmp_path)
    assert list(hashes) == ["a.txt", "b.jsonl"]
    assert hashes["a.txt"] == hashlib.sha256(b"alpha\n").hexdigest()
    assert file_hashes(a) == {"a.txt": hashes["a.txt"]}
    write(a, "alpha!\n")
    assert file_hashes(tmp_path)["a.txt"] != hashes["a.txt"]


# -----------------------------------------------------------------------------
# shipped sample prompts

def test_sample_prompts_load(chat_tok):
    prompts = load_prompts(None, chat_tok, max_model_len=BIG)
    assert len(prompts) >= 40
    assert [p.prompt_id for p in prompts] == list(range(len(prompts)))
    per_file = Counter(p.source.split(":")[0] for p in prompts)
    assert set(per_file) == {"chat.jsonl", "code.txt", "long.txt", "math.txt", "multilingual.txt", "prose.txt"}
    assert set(file_hashes(default_prompts_path())) == set(per_file)

    chat = [p for p in prompts if p.source.startswith("chat.jsonl")]
    assert sum(p.text.startswith("<|im_start|>system") for p in chat) == 8
    code = [p.text for p in prompts if p.source.startswith("code.txt")]
    assert any("\n\n" in t for t in code)  # `---` kept the blank lines inside functions
    long = [p.text for p in prompts if p.source.startswith("long.txt")]
    assert all(600 <= len(t.split()) <= 1200 for t in long)


def test_a_file_past_the_bound_is_refused_before_it_is_held(tmp_path, monkeypatch):
    """A prompts file is read whole: past the bound (lowered here) it is refused, naming the bound."""
    import divergence_probe.prompts as prompts

    monkeypatch.setattr(prompts, "MAX_FILE_BYTES", 2**20)
    f = write(tmp_path / "p.txt", "hi\n" * 2**19)
    with pytest.raises(PromptError, match="is over 1 MiB, the bound on a prompts file"):
        read_prompt_sources(f)
