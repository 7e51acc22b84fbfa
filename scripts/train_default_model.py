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
import json
import math
import platform
import statistics
import tempfile
import textwrap
import time
from pathlib import Path

import torch
import transformers

from lm_training import (HOLDOUT_EVERY, ROOT, check_out, corpus_hashes, cpu_name, encode, save, stdlib_modules,
                         train, write_folder)

from divergence_probe.models import modelzoo# noqa: E402  (lm_training put the checkout on sys.path)
from divergence_probe.prompts import default_prompts_path, load_prompts  # noqa: E402

DEFAULT_OUT = ROOT / "divergence_probe" / "data" / "default_model"
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
    check_out(out, args.overwrite, "MODEL.md")

    config = modelzoo.make_config(arch="qwen3", preset="tiny")
    tokenizer = modelzoo.build_tokenizer(model_max_length=config.max_position_embeddings)
    stdlib, files = stdlib_modules()
    val_files = files[::HOLDOUT_EVERY]
    train_files = [f for i, f in enumerate(files) if i % HOLDOUT_EVERY]
    t = time.perf_counter()
    train_stream = encode([f.read_text(encoding="utf-8") for f in train_files], tokenizer)
    val_stream = encode([f.read_text(encoding="utf-8") for f in val_files], tokenizer)
    print(f"{len(files)} stdlib files from {stdlib}: {len(train_stream):,} train and {len(val_stream):,} validation "
          f"tokens, tokenized in {time.perf_counter() - t:.0f}s", flush=True)
    names_sha, contents_sha = corpus_hashes([(f.name, f) for f in files])

    model, log, evals, final = train(args, config, train_stream, val_stream, val_tokens=VAL_TOKENS)
    params = sum(p.numel() for p in model.parameters())
    info = {}

    def fill(tmp: Path) -> None:
        save(model, tokenizer, tmp)
        weights_bytes = (tmp / "model.safetensors").stat().st_size
        assert weights_bytes <= MAX_WEIGHTS_BYTES, f"model.safetensors is {weights_bytes} bytes, over the 10 MB budget"
        with tempfile.TemporaryDirectory() as random_dir:
            random_model = modelzoo.make_model(Path(random_dir) / "m", arch="qwen3", preset="tiny", seed=0)
            random_entropy = entropies(random_model)
        info.update({
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
        })
        (tmp / "MODEL.md").write_text(card(args, info), encoding="utf-8")
        (tmp / "MODEL.md").chmod(0o644)

    write_folder(out, fill)
    e, r = info["entropy"], info["random_entropy"]
    print(f"wrote {out}: {params:,} parameters, {info['weights_mb']:.2f} MB; train loss {final['train_loss']:.3f}, "
          f"val loss {final['val_loss']:.3f}; mean entropy {e['mean']:.3f} nats (random {r['mean']:.3f})")
    print("sample:", repr(info["sample"]))


if __name__ == "__main__":
    main()
