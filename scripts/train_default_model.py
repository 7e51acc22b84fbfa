"""Train the built-in default model: modelzoo's tiny Qwen3, trained on the Python standard library's own sources.

    .venv/bin/python scripts/train_default_model.py --overwrite        # ~10 min (one core of a shared 2-core machine)
    .venv/bin/python scripts/train_default_model.py --steps 40 --out /tmp/dm    # a smoke run, under a minute

Why: a model with random weights predicts a near-uniform next-token distribution (entropy ~ln(vocab)), while the
policies of RL runs are peaked, and how far two stacks' logprobs drift depends on that. A small trained model gives
`compare` peaked distributions without a model hub.

What it writes into --out (default divergence_probe/data/default_model/, which ships in the package): the files of
a modelzoo checkpoint (config.json, BF16 model.safetensors, the modelzoo tokenizer, generation_config.json with
only the token ids) plus MODEL.md, the model card with every number of this run. The folder is written next to
--out and renamed into place when complete.

Data: every top-level *.py module of `sysconfig.get_paths()["stdlib"]` (no packages, so no test suite and no
site-packages), sorted by name; every 20th file is held out for validation. It exists on every machine with
Python, but differs between Python versions, so the card records the version and a hash of the file list and of
the contents. The model is trained in float32 with AdamW, first on 256-token windows, then, for the last 15% of the
steps, on 1024-token windows (same tokens per step), because sample_prompts/ has prompts of ~1600 tokens and
positions never seen in training are out of distribution.

Reproducibility: fixed seed, one torch thread, torch.use_deterministic_algorithms(True), data order from a
seeded generator. The same torch version and CPU instruction set give the same weights; another CPU (AVX2 vs
AVX-512 kernels) or thread count sums in another order and ends at slightly different weights. One thread, not
two: on a shared 2-core machine two OpenMP threads wait on each other whenever a core is busy elsewhere (a step
took 3x longer with 2 threads than with 1 while another job ran), and one thread needs no agreement on core count.
"""

import argparse
import hashlib
import json
import math
import os
import platform
import secrets
import shutil
import statistics
import sys
import sysconfig
import tempfile
import textwrap
import time
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from divergence_probe import modelzoo  # noqa: E402
from divergence_probe.prompts import default_prompts_path, load_prompts  # noqa: E402

DEFAULT_OUT = ROOT / "divergence_probe" / "data" / "default_model"
HOLDOUT_EVERY = 20  # every 20th stdlib file (by sorted name) is validation data, never trained on
LONG_FRACTION = 0.15  # the last 15% of the steps train on long windows
VAL_TOKENS = 16384  # validation loss on the first 16k held-out tokens: a fixed set, a few seconds per evaluation
SAMPLE_PROMPT = 'def read_lines(path):\n    """Return the lines of a text file, without trailing newlines."""\n'
SAMPLE_TOKENS = 64
MAX_WEIGHTS_BYTES = 10 * 2**20  # the weights ship inside the package, so keep them small


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: %(default)s)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it holds a model")
    p.add_argument("--steps", type=int, default=700, help="optimizer steps (default: %(default)s)")
    p.add_argument("--batch-tokens", type=int, default=4096, help="tokens per step (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=256, help="window length of the first phase (default: %(default)s)")
    p.add_argument("--long-seq-len", type=int, default=1024,
                   help="window length of the last phase (default: %(default)s)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=100, help="linear warm-up steps (default: %(default)s)")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW decay of matrices (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads; part of what fixes the result (default: %(default)s)")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=200)
    return p.parse_args()


# -----------------------------------------------------------------------------
# data


def corpus_files() -> tuple[Path, list[Path]]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return stdlib, sorted(stdlib.glob("*.py"), key=lambda p: p.name)


def corpus_hashes(files: list[Path]) -> tuple[str, str]:
    """sha256 of the file names (one per line), and of names and contents together."""
    names = "".join(f"{f.name}\n" for f in files).encode()
    contents = hashlib.sha256()
    for f in files:
        contents.update(f"{f.name}\0{hashlib.sha256(f.read_bytes()).hexdigest()}\n".encode())
    return hashlib.sha256(names).hexdigest(), contents.hexdigest()


def encode(files: list[Path], tokenizer) -> torch.Tensor:
    """All files as one stream of token ids, each file followed by <|endoftext|>."""
    texts = [f.read_text(encoding="utf-8") for f in files]
    eot = tokenizer.convert_tokens_to_ids(modelzoo.ENDOFTEXT)
    stream = []
    for ids in tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]:
        stream += ids + [eot]
    return torch.tensor(stream, dtype=torch.long)


def windows(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    n = len(stream) // seq_len
    return stream[: n * seq_len].view(n, seq_len)  # (n, seq_len), non-overlapping


class Batches:
    """Batches of windows in a seeded random order, a new permutation every epoch."""

    def __init__(self, data: torch.Tensor, batch: int, gen: torch.Generator):
        self.data, self.batch, self.gen = data, batch, gen
        self.order, self.pos, self.epochs = torch.randperm(len(data), generator=gen), 0, 0

    def next(self) -> torch.Tensor:
        if self.pos + self.batch > len(self.order):
            self.order, self.pos, self.epochs = torch.randperm(len(self.data), generator=self.gen), 0, self.epochs + 1
        idx = self.order[self.pos: self.pos + self.batch]
        self.pos += self.batch
        return self.data[idx]  # (batch, seq_len)


# -----------------------------------------------------------------------------
# training


def lr_at(step: int, args) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


@torch.no_grad()
def mean_loss(model, data: torch.Tensor, batch: int) -> float:
    model.eval()
    losses = [model(input_ids=data[i: i + batch], labels=data[i: i + batch]).loss.item()
              for i in range(0, len(data), batch)]
    model.train()
    return statistics.fmean(losses)


def train(args, config, train_stream, val_stream):
    torch.manual_seed(args.seed)
    # float32 master weights; the BF16 copy is made only when saving
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    # nanoGPT's split: decay the matrices (embedding included), not the norm weights
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, foreach=False, fused=False)

    gen = torch.Generator().manual_seed(args.seed)
    long_from = args.steps - int(args.steps * LONG_FRACTION)
    phases = {
        "short": Batches(windows(train_stream, args.seq_len), args.batch_tokens // args.seq_len, gen),
        "long": Batches(windows(train_stream, args.long_seq_len), args.batch_tokens // args.long_seq_len, gen),
    }
    val_short = windows(val_stream[:VAL_TOKENS], args.seq_len)
    val_long = windows(val_stream[:VAL_TOKENS], args.long_seq_len)

    log, evals, window = [], [], []
    t0 = time.perf_counter()
    for step in range(args.steps):
        phase = "short" if step < long_from else "long"
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        x = phases[phase].next()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        window.append(loss.item())
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            elapsed = time.perf_counter() - t0
            log.append({"step": step + 1, "phase": phase, "seq_len": x.shape[1], "train_loss": statistics.fmean(window),
                        "lr": lr_at(step, args), "elapsed_s": elapsed})
            window = []
            print(f"step {step + 1:5d}  {phase:5s}  loss {log[-1]['train_loss']:.3f}  lr {log[-1]['lr']:.2e}  "
                  f"{elapsed:6.1f}s  {(step + 1) / elapsed:.2f} steps/s", flush=True)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            t_eval = time.perf_counter()
            evals.append({"step": step + 1, "val_loss": mean_loss(model, val_short, args.batch_tokens // args.seq_len)})
            t0 += time.perf_counter() - t_eval  # wall time reported is training time only
            print(f"step {step + 1:5d}  val loss ({args.seq_len}-token windows) {evals[-1]['val_loss']:.3f}",
                  flush=True)
    wall = time.perf_counter() - t0
    final = {
        "train_loss": log[-1]["train_loss"],
        "val_loss": evals[-1]["val_loss"],
        "val_loss_long": mean_loss(model, val_long, args.batch_tokens // args.long_seq_len),
        "epochs_short": phases["short"].epochs, "epochs_long": phases["long"].epochs,
        "long_from": long_from, "wall_s": wall,
    }
    return model, log, evals, final


# -----------------------------------------------------------------------------
# saving, in modelzoo's layout


def save(model, tokenizer, out_dir: Path) -> None:
    config = model.config
    tokenizer.save_pretrained(out_dir)
    model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.generation_config = transformers.GenerationConfig(
        # as modelzoo: only the token ids, since vLLM takes sampling defaults from this file too
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
    )
    model.save_pretrained(out_dir, max_shard_size="1000GB")
    for path in out_dir.iterdir():
        path.chmod(0o644)  # safetensors writes 0600; package data must be readable by everyone


# -----------------------------------------------------------------------------
# evaluation of the saved checkpoint, with transformers


@torch.no_grad()
def entropies(model_dir: Path) -> dict:
    """Next-token entropy (nats) at every scored position of sample_prompts/, as compare scores them."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)  # BF16, as saved
    model.eval()
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    prompts = load_prompts(default_prompts_path(), tok, max_model_len=model.config.max_position_embeddings)
    per_file: dict[str, list[float]] = {}
    short, long = [], []
    nll = []
    for prompt in prompts:
        ids = torch.tensor([prompt.token_ids])
        logp = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)  # (T-1, vocab): position t predicts t+1
        h = -(logp.exp() * logp).sum(-1)
        nll += (-logp.gather(-1, ids[0, 1:, None])[:, 0]).tolist()
        per_file.setdefault(prompt.source.split(":")[0], []).extend(h.tolist())
        short += h[:256].tolist()
        long += h[256:].tolist()
    every = [x for hs in per_file.values() for x in hs]
    return {
        "n_prompts": len(prompts), "n_positions": len(every),
        "mean": statistics.fmean(every), "median": statistics.median(every),
        "mean_nll": statistics.fmean(nll),
        "frac_below_1": sum(x < 1 for x in every) / len(every),
        "positions_lt_256": statistics.fmean(short),
        "positions_ge_256": statistics.fmean(long) if long else float("nan"),
        "per_file": {name: statistics.fmean(hs) for name, hs in per_file.items()},
    }


@torch.no_grad()
def greedy_sample(model_dir: Path) -> str:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    ids = tok(SAMPLE_PROMPT, return_tensors="pt")
    out = model.generate(**ids, do_sample=False, max_new_tokens=SAMPLE_TOKENS)
    return tok.decode(out[0, ids["input_ids"].shape[1]:])


def norm_weights_not_one(model_dir: Path) -> float:
    """Fraction of BF16 RMSNorm weights that are not exactly 1 (modelzoo's convention: ~98%; 1 hides rounding)."""
    from safetensors.torch import load_file

    norms = [w for name, w in load_file(model_dir / "model.safetensors").items() if "norm" in name]
    return min((w != 1).float().mean().item() for w in norms)


def cpu_name() -> str:
    """The CPU model and whether it has AVX-512: what decides which kernels (and summation orders) torch runs."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    return f"{name} ({'AVX-512' if 'avx512f' in info else 'no AVX-512'})"


# -----------------------------------------------------------------------------
# the model card


def para(text: str) -> str:
    """One Markdown paragraph, filled to 115 columns (the numbers put in vary in width)."""
    return textwrap.fill(" ".join(text.split()), width=115, break_on_hyphens=False, break_long_words=False)


def card(args, info: dict) -> str:
    c, f, e, r = info["config"], info["final"], info["entropy"], info["random_entropy"]
    uniform = math.log(c["vocab_size"])
    loss_rows = "\n".join(
        f"| {row['step']} | {row['seq_len']} | {row['train_loss']:.3f} | {info['val'].get(row['step'], '')} "
        f"| {row['lr']:.2e} | {row['elapsed_s']:.0f} |"
        for row in info["log"]
    )
    files = sorted(set(e["per_file"]) | set(r["per_file"]))
    entropy_rows = "\n".join(f"| {name} | {e['per_file'][name]:.2f} | {r['per_file'][name]:.2f} |" for name in files)
    fence = "````"
    builtin = para(f"""
`divergence-probe compare` without `--model` runs this checkpoint: modelzoo's `tiny` Qwen3 ({info['params']:,}
parameters, {info['weights_mb']:.1f} MB in BF16, the modelzoo tokenizer), trained for {args.steps} steps
({f['wall_s'] / 60:.0f} minutes on one CPU core) on the Python {info['python']} standard library's own sources. Its
next-token distributions are peaked as a trained policy's are: mean entropy {e['mean']:.2f} nats on `sample_prompts/`,
against {r['mean']:.2f} for random weights (uniform: {uniform:.2f}). It ships in the package; without the package data,
the random tiny Qwen3 is built instead. `scripts/train_default_model.py` rebuilds it.
""")
    architecture = para(f"""
`Qwen3ForCausalLM` with `modelzoo.make_config(arch="qwen3", preset="tiny")` unchanged: hidden {c['hidden_size']},
{c['num_hidden_layers']} layers, {c['num_attention_heads']} query heads and {c['num_key_value_heads']} KV heads of
dimension {c['head_dim']}, SwiGLU intermediate {c['intermediate_size']}, vocabulary {c['vocab_size']}
({modelzoo.TOKENIZER_SIZE} tokens padded to a multiple of 64), tied embeddings, RoPE theta {c['rope_theta']:g},
RMSNorm eps {c['rms_norm_eps']:g}, context {c['max_position_embeddings']}. {info['params']:,} parameters;
`model.safetensors` is {info['weights_bytes']:,} bytes (every tensor BF16). config.json, generation_config.json and
the tokenizer files are byte-identical to those of `make-model` (qwen3, tiny). In every RMSNorm at least
{info['norm_not_one']:.1%} of the trained BF16 weights differ from 1, so a stack's rounding after x·w shows.
""")
    data = para(f"""
Every top-level `*.py` module of `sysconfig.get_paths()["stdlib"]` (not recursive: no packages, so no test suite and
no site-packages), sorted by file name, read as UTF-8, each tokenized alone and followed by `<|endoftext|>`. Files
whose index in that order is a multiple of {HOLDOUT_EVERY} are held out for validation. The standard library differs
between Python versions: a rebuild on another version trains on other data (compare the hashes).
""")
    training = para(f"""
float32 weights, AdamW (betas 0.9/0.95, eps 1e-8, weight decay {args.weight_decay} on matrices only), gradient
clipping 1.0, peak lr {args.lr:g} with {args.warmup} warm-up steps and cosine decay to a tenth. {args.steps} steps of
{args.batch_tokens} tokens: steps 1-{f['long_from']} on {args.seq_len}-token windows (batch
{args.batch_tokens // args.seq_len}), steps {f['long_from'] + 1}-{args.steps} on {args.long_seq_len}-token windows
(batch {args.batch_tokens // args.long_seq_len}), non-overlapping windows in a seeded random order
({f['epochs_short']} complete pass{'es' if f['epochs_short'] != 1 else ''} over the short windows). Seed {args.seed},
torch threads: {args.threads}, `torch.use_deterministic_algorithms(True)`, SDPA attention. Then cast to BF16 and saved
with `save_pretrained`. The same torch version, thread count and CPU instruction set give the same weights; other
CPUs sum in another order.
""")
    entropy_text = para(f"""
Computed with transformers on the saved BF16 checkpoint (`logits.float().log_softmax(-1)`) at every position
`compare` scores ({e['n_prompts']} prompts, {e['n_positions']:,} positions), against modelzoo's random `tiny` Qwen3
(seed 0, the fallback default). Uniform over the vocabulary would be {uniform:.3f} nats.
""")
    return f"""# divergence-probe default model

## Built-in model
{builtin}

## Architecture
{architecture}

## Training data
{data}
- Python {info['python']} ({info['python_impl']}), stdlib at `{info['stdlib']}`
- {info['n_files']} files, {info['corpus_bytes']:,} bytes: {info['n_train_files']} train \
({info['train_tokens']:,} tokens), {info['n_val_files']} validation ({info['val_tokens']:,} tokens)
- sha256 of the file names, one per line: `{info['names_sha256']}`
- sha256 of names and contents (`name\\0sha256(bytes)\\n` per file): `{info['contents_sha256']}`
- validation files: {', '.join(info['val_files'])}

## Training
{training}
- torch {info['torch']}, transformers {info['transformers']}, CPU: {info['cpu']}
- training wall time: {f['wall_s']:.0f} s ({args.steps / f['wall_s']:.2f} steps/s; evaluation excluded)
- final train loss (mean of the last {args.log_every} steps): {f['train_loss']:.3f} nats/token
- final validation loss on the first {VAL_TOKENS:,} held-out tokens: {f['val_loss']:.3f} ({args.seq_len}-token \
windows), {f['val_loss_long']:.3f} ({args.long_seq_len}-token windows); a uniform guess is {uniform:.3f}

| step | window | train loss | val loss | lr | s |
|---|---|---|---|---|---|
{loss_rows}

## Next-token entropy on `sample_prompts/`
{entropy_text}

| | trained | random |
|---|---|---|
| mean entropy (nats) | {e['mean']:.3f} | {r['mean']:.3f} |
| median entropy | {e['median']:.3f} | {r['median']:.3f} |
| positions with entropy < 1 nat | {e['frac_below_1']:.1%} | {r['frac_below_1']:.1%} |
| mean entropy, positions < 256 | {e['positions_lt_256']:.3f} | {r['positions_lt_256']:.3f} |
| mean entropy, positions >= 256 | {e['positions_ge_256']:.3f} | {r['positions_ge_256']:.3f} |
| mean NLL of the actual next token | {e['mean_nll']:.3f} | {r['mean_nll']:.3f} |

| file | trained | random |
|---|---|---|
{entropy_rows}

## Sample
Greedy (`generate(do_sample=False, max_new_tokens={SAMPLE_TOKENS})`, transformers, BF16), prompt then continuation:
{fence}python
{SAMPLE_PROMPT}{info['sample']}
{fence}

## Rebuild
```bash
.venv/bin/python scripts/train_default_model.py --overwrite
```
"""


# -----------------------------------------------------------------------------


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    out = args.out.expanduser().absolute()
    if out.exists() and any(out.iterdir()):
        if not args.overwrite:
            sys.exit(f"{out} exists and is not empty; pass --overwrite")
        if not (out / "config.json").is_file():
            sys.exit(f"{out} is not a model folder (no config.json); will not overwrite it")

    config = modelzoo.make_config(arch="qwen3", preset="tiny")
    tokenizer = modelzoo.build_tokenizer(model_max_length=config.max_position_embeddings)
    stdlib, files = corpus_files()
    val_files = files[::HOLDOUT_EVERY]
    train_files = [f for i, f in enumerate(files) if i % HOLDOUT_EVERY]
    t = time.perf_counter()
    train_stream, val_stream = encode(train_files, tokenizer), encode(val_files, tokenizer)
    print(f"{len(files)} stdlib files from {stdlib}: {len(train_stream):,} train and {len(val_stream):,} validation "
          f"tokens, tokenized in {time.perf_counter() - t:.0f}s", flush=True)
    names_sha, contents_sha = corpus_hashes(files)

    model, log, evals, final = train(args, config, train_stream, val_stream)

    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    tmp.mkdir(parents=True)
    try:
        save(model, tokenizer, tmp)
        params = sum(p.numel() for p in model.parameters())
        weights_bytes = (tmp / "model.safetensors").stat().st_size
        assert weights_bytes <= MAX_WEIGHTS_BYTES, f"model.safetensors is {weights_bytes} bytes, over the 10 MB budget"
        with tempfile.TemporaryDirectory() as random_dir:
            random_model = modelzoo.make_model(Path(random_dir) / "m", arch="qwen3", preset="tiny", seed=0)
            random_entropy = entropies(random_model)
        info = {
            # transformers 5 keeps rope_theta inside config.json's rope_parameters
            "config": json.loads((tmp / "config.json").read_text())
            | {"rope_theta": config.rope_parameters["rope_theta"]},
            "params": params, "weights_bytes": weights_bytes, "weights_mb": weights_bytes / 2**20,
            "norm_not_one": norm_weights_not_one(tmp),
            "python": platform.python_version(), "python_impl": platform.python_implementation(),
            "stdlib": str(stdlib), "n_files": len(files), "corpus_bytes": sum(f.stat().st_size for f in files),
            "n_train_files": len(train_files), "n_val_files": len(val_files),
            "train_tokens": len(train_stream), "val_tokens": len(val_stream),
            "val_files": [f.name for f in val_files], "names_sha256": names_sha, "contents_sha256": contents_sha,
            "cpu": cpu_name(), "torch": torch.__version__, "transformers": transformers.__version__,
            "log": log, "val": {row["step"]: f"{row['val_loss']:.3f}" for row in evals}, "final": final,
            "entropy": entropies(tmp), "random_entropy": random_entropy, "sample": greedy_sample(tmp),
        }
        (tmp / "MODEL.md").write_text(card(args, info), encoding="utf-8")
        (tmp / "MODEL.md").chmod(0o644)
        old = None
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
            out.rename(old)
        tmp.rename(out)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    e, r = info["entropy"], info["random_entropy"]
    print(f"wrote {out}: {params:,} parameters, {weights_bytes / 2**20:.2f} MB; train loss {final['train_loss']:.3f}, "
          f"val loss {final['val_loss']:.3f}; mean entropy {e['mean']:.3f} nats (random {r['mean']:.3f})")
    print("sample:", repr(info["sample"]))


if __name__ == "__main__":
    main()
