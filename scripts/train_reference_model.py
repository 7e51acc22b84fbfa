"""Train the reference model: Qwen3-0.6B's decoder layer at 10 layers (~160M parameters), on the Python sources of
this machine, in about 10 minutes of an H200.

    .venv/bin/python scripts/train_reference_model.py --device cuda --minutes 10 --out runs/reference-model
    .venv/bin/python scripts/train_reference_model.py --size tiny --steps 30 --out /tmp/ref-tiny   # CPU, seconds

Why: on seeded random weights one kernel change moves logprobs as much as the whole vLLM-vs-transformers gap; the
published claims about RoPE, SwiGLU and RMSNorm alignment can only be tested on trained weights, and none can be
downloaded here. The built-in model (scripts/train_default_model.py) is trained but 1M parameters at head_dim 32.

Shape (`--size reference`): every tensor of a layer is Qwen3-0.6B's (hidden 1024, 16 query and 8 KV heads of 128,
SwiGLU 3072, QK-norm, tied embeddings, RoPE theta 1e6), so the GEMMs and attention kernels run at a published model's
sizes; only the depth (10 of 28 layers, what the H200 trains in 10 minutes), the vocabulary (the built-in tokenizer's
2000 tokens padded to 2048) and the context (2048, the longest window trained on) differ. `--size tiny` keeps the
ratios (head_dim 128, two query heads per KV head, query width 2x hidden, SwiGLU 3x hidden) at 2.5M parameters for
the CPU smoke test, in FP32 (the reference size trains under BF16 autocast).

Data: the standard library's *.py files (recursively, without its site-packages), then those of the interpreter's
site directories (sysconfig's purelib and platlib, site.getsitepackages()), each tree walked in sorted order, files
over 1 MiB, not UTF-8, or repeating an earlier file's bytes skipped, until the next file would pass the byte cap
(--corpus-bytes). Held out: the built-in model's validation files (every 20th top-level stdlib module), and any copy
of them; so both models are scored on text neither trained on. training.json records the file count, bytes, tokens
and hashes: another machine has other packages, hence another corpus.

Training: lm_training.train, as the built-in model, but FP32 master weights under BF16 autocast, micro-batches whose
gradients add up to 256k-token steps, fused AdamW on CUDA. Deterministic: fixed seeds, data order from a seeded
generator, torch.use_deterministic_algorithms(True) (cuBLAS with CUBLAS_WORKSPACE_CONFIG=:4096:8, the deterministic
flash-attention backward), so a rerun on the same GPU and software repeats every step's loss; --minutes times steps
2-12 and fixes the step count then, so a rerun with `--steps N` (printed, and in training.json) re-makes the run.

Writes --out (a checkpoint folder that `divergence-probe compare --model` loads: config.json, BF16 model.safetensors,
the built-in tokenizer, generation_config.json) and training.json in it: the corpus, the loss curve, the held-out
loss against a unigram model and the built-in model, and per layer the residual stream's max |h| / median |h|
(massive activations) and the attention entropy, for the trained model, its initialisation and the built-in model.
"""

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before torch: deterministic cuBLAS needs it

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import site  # noqa: E402
import sysconfig  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402

from lm_training import (check_out, corpus_hashes, cpu_name, encode, fail, heldout_modules, mean_loss,  # noqa: E402
                         save, train, windows, write_folder)

from divergence_probe.models import modelzoo# noqa: E402
from divergence_probe.engines.layouts import layout_of  # noqa: E402
from divergence_probe.models import find  # noqa: E402

REPORT = "training.json"
EVAL_WINDOW = 1024  # held-out loss on 1024-token windows: the longest the built-in model trained on
MAX_FILE_BYTES = 2**20  # larger *.py files are generated tables (unicode data, protobuf), not code
VOCAB = -(-modelzoo.TOKENIZER_SIZE // 64) * 64  # the built-in tokenizer, padded to a multiple of 64 as modelzoo does


@dataclass(frozen=True)
class Size:
    layers: int
    overrides: dict  # Qwen3-0.6B's config fields that this size changes (besides the depth)
    batch_tokens: int  # tokens per optimizer step
    micro_batch_tokens: int  # tokens per forward/backward
    seq_len: int  # window of the first 85% of the steps
    long_seq_len: int  # window of the last 15%
    lr: float
    warmup: int
    corpus_bytes: int  # default --corpus-bytes
    eval_tokens: int  # held-out tokens scored (the whole held-out set is ~108k)
    stats_windows: int  # held-out windows of EVAL_WINDOW tokens the activation statistics are taken on
    steps: int | None  # default --steps; None: --minutes
    minutes: float | None
    amp: bool = True  # BF16 autocast over FP32 weights; False: FP32 throughout


SIZES = {
    # sized for 10 minutes of an H200: the FLOP estimate and what it buys, docs/results/h200/trained/README.md
    "reference": Size(layers=10, overrides={"vocab_size": VOCAB, "max_position_embeddings": 2048},
                      batch_tokens=262144, micro_batch_tokens=32768, seq_len=1024, long_seq_len=2048, lr=1e-3,
                      warmup=50, corpus_bytes=256 * 2**20, eval_tokens=2**20, stats_windows=4, steps=None,
                      minutes=10.0),
    "tiny": Size(layers=2, overrides={"vocab_size": VOCAB, "max_position_embeddings": 2048, "hidden_size": 256,
                                      "intermediate_size": 768, "num_attention_heads": 4, "num_key_value_heads": 2},
                 batch_tokens=2048, micro_batch_tokens=1024, seq_len=64, long_seq_len=128, lr=3e-3, warmup=12,
                 corpus_bytes=2**20, eval_tokens=2048, stats_windows=1, steps=30, minutes=None,
                 # FP32 on the CPU: a CPU without BF16 instructions (AVX2 only) runs BF16 GEMMs several times slower
                 # than FP32 ones, and the smoke test is about the script's logic, not the H200's precision
                 amp=False),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="output folder (the checkpoint)")
    p.add_argument("--size", choices=list(SIZES), default="reference",
                   help="reference: ~160M parameters, for the H200; tiny: 2.5M, a CPU smoke test "
                        "(default: %(default)s)")
    p.add_argument("--device", default="auto", help="auto (cuda if there is one), cpu, cuda, cuda:N (default: auto)")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--steps", type=int, help="optimizer steps (default: the size's; reference: --minutes 10)")
    budget.add_argument("--minutes", type=float, help="train about this long; the step count is fixed after step 12")
    p.add_argument("--corpus-bytes", type=int, help="byte cap of the training corpus (default: the size's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: %(default)s)")
    p.add_argument("--overwrite", action="store_true", help=f"replace --out if this script wrote it (has {REPORT})")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=100)
    args = p.parse_args(argv)
    size = SIZES[args.size]
    if args.steps is None and args.minutes is None:
        args.steps, args.minutes = size.steps, size.minutes
    if args.steps is not None and args.steps < 1 or args.minutes is not None and args.minutes <= 0:
        fail("--steps and --minutes must be positive")
    for flag in ("corpus_bytes", "threads", "log_every", "eval_every"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            fail(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    args.corpus_bytes = size.corpus_bytes if args.corpus_bytes is None else args.corpus_bytes
    # the names lm_training.train reads
    args.batch_tokens, args.seq_len, args.long_seq_len = size.batch_tokens, size.seq_len, size.long_seq_len
    args.lr, args.warmup, args.weight_decay = size.lr, size.warmup, 0.1
    return args


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        fail(f"--device {name} is not a device; pass auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        fail(f"--device {name}: this torch ({torch.__version__}) sees no CUDA GPU; pass --device cpu or install "
             "CUDA torch")
    if device.type not in ("cpu", "cuda"):
        fail(f"--device {name}: only cpu and cuda are supported")
    if device.type == "cuda" and device.index is not None:
        if device.index >= torch.cuda.device_count():
            fail(f"--device {name}: there are {torch.cuda.device_count()} CUDA devices; pass cuda:0 .. "
                 f"cuda:{torch.cuda.device_count() - 1}")
        torch.cuda.set_device(device)  # so that what transformers puts on "cuda" lands here too
    return device


def make_config(size: Size):
    config = modelzoo.make_config(arch="qwen3", preset="qwen3-0.6b", num_layers=size.layers)
    config.update(size.overrides)
    return config


def flops_per_token(config, seq_len: int) -> float:
    """Training FLOPs a token: 6 per weight of every matmul (forward 2, backward 4; the tied embedding's lookup is
    free but the head is a matmul) plus causal attention's QK^T and PV (half of 12 * seq * query width a layer)."""
    c = config
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    matmul = c.num_hidden_layers * layer + c.hidden_size * c.vocab_size
    return 6 * matmul + 6 * c.num_hidden_layers * seq_len * q


# -----------------------------------------------------------------------------
# corpus


def _walk(root: Path, skip: set[str]):
    """*.py files under root in sorted order (directories sorted in place), not following links."""
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in skip and not os.path.islink(os.path.join(folder, d)))
        for name in sorted(files):
            path = Path(folder, name)
            if name.endswith(".py") and not path.is_symlink():
                yield path


def gather_corpus(cap: int, exclude: set[str]) -> tuple[list[tuple[str, Path, str]], dict]:
    """(name, path, text) of the training files and what was skipped; `exclude` holds the held-out files' sha256."""
    paths = sysconfig.get_paths()
    roots = [("stdlib", Path(paths["stdlib"]), {"site-packages", "dist-packages", "__pycache__"})]
    # the interpreter's site directories (a venv's own; on Debian also /usr/lib/python3/dist-packages), not
    # PYTHONPATH, which holds whatever the caller put there (the checkout itself, for one)
    sites = [paths["purelib"], paths["platlib"], *site.getsitepackages()]
    for folder in dict.fromkeys(str(Path(d).resolve()) for d in sites if Path(d).is_dir()):
        roots.append((f"site{len(roots)}", Path(folder), {"__pycache__"}))
    files, seen, total = [], set(exclude), 0
    skipped = {"heldout_copy": 0, "duplicate": 0, "over_1MiB": 0, "not_utf8": 0}
    for label, root, skip in roots:
        for path in _walk(root, skip):
            try:
                data = path.read_bytes()
            except OSError:
                continue
            digest = hashlib.sha256(data).hexdigest()
            if digest in seen:
                skipped["heldout_copy" if digest in exclude else "duplicate"] += 1
                continue
            if len(data) > MAX_FILE_BYTES:
                skipped["over_1MiB"] += 1
                continue
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                skipped["not_utf8"] += 1
                continue
            if total + len(data) > cap:
                return files, {"roots": {label_: str(r) for label_, r, _ in roots}, "skipped": skipped,
                               "cap_reached": True}
            seen.add(digest)
            total += len(data)
            files.append((f"{label}/{path.relative_to(root).as_posix()}", path, text))
    return files, {"roots": {label_: str(r) for label_, r, _ in roots}, "skipped": skipped, "cap_reached": False}


# -----------------------------------------------------------------------------
# evaluation


def load(path: Path, device: torch.device, attn: str = "sdpa"):
    """A saved checkpoint in float32 (BF16 weights upcast exactly): the model's numbers, not one stack's rounding."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn)
    return model.to(device).eval()


def unigram_loss(train_stream: torch.Tensor, targets: torch.Tensor) -> float:
    """Cross-entropy of the targets under the training tokens' frequencies (add-one smoothed): the loss of a model
    that ignores context."""
    counts = torch.bincount(train_stream, minlength=VOCAB).double() + 1
    return -(counts / counts.sum()).log()[targets].mean().item()


@torch.no_grad()
def activation_stats(model, data: torch.Tensor, device: torch.device) -> list[dict]:
    """Per decoder layer, over the windows in `data`: the residual stream after the layer (max |h|, median |h|,
    their ratio, where the max sits) and the attention (mean entropy of a query's distribution in nats, mean weight
    on the window's first token, the attention sink). Needs eager attention (output_attentions)."""
    layers = find(model, layout_of(model, "hf").model["layers"])
    resid = [[] for _ in layers]

    def keep(k):
        return lambda module, args, out: resid[k].append((out[0] if isinstance(out, tuple) else out)[0].abs().cpu())

    hooks = [layer.register_forward_hook(keep(k)) for k, layer in enumerate(layers)]
    entropy, sink = [[] for _ in layers], [[] for _ in layers]
    try:
        for window in data:
            out = model(input_ids=window[None].to(device), output_attentions=True)
            for k, att in enumerate(out.attentions):
                p = att[0].float()  # (heads, T, T), rows sum to 1 over the causal prefix
                entropy[k].append(-torch.special.xlogy(p, p).sum(-1).mean().item())
                sink[k].append(p[..., 0].mean().item())
    finally:
        for hook in hooks:
            hook.remove()
    rows = []
    for k, hs in enumerate(resid):
        h = torch.stack(hs)  # (windows, T, hidden)
        flat = h.argmax().item()
        median = h.median().item()
        rows.append({"layer": k, "max_abs": h.max().item(), "median_abs": median,
                     "max_over_median": h.max().item() / median, "max_position": flat // h.shape[2] % h.shape[1],
                     "max_channel": flat % h.shape[2], "attn_entropy": sum(entropy[k]) / len(entropy[k]),
                     "attn_first_token": sum(sink[k]) / len(sink[k])})
    return rows


def evaluate(out: Path, config, seed: int, device, heldout: torch.Tensor, train_stream, size: Size) -> dict:
    """Held-out loss of the saved model, its initialisation, the built-in model and a unigram model on the same
    windows, and the activation statistics of the saved model, its initialisation and the built-in model."""
    short, long = windows(heldout, EVAL_WINDOW), windows(heldout, config.max_position_embeddings)
    stats = short[: size.stats_windows]
    trained = load(out, device)
    builtin = load(modelzoo.SHIPPED_MODEL, device)
    losses = {
        "window": EVAL_WINDOW, "windows": len(short), "tokens_scored": short[:, 1:].numel(),
        "reference": mean_loss(trained, short, 8, device),
        "builtin": mean_loss(builtin, short, 8, device),
        "unigram": unigram_loss(train_stream, short[:, 1:].flatten()),
        "uniform": math.log(VOCAB),
        f"reference_{long.shape[1]}": mean_loss(trained, long, 4, device) if len(long) else None,
    }
    del trained, builtin
    torch.manual_seed(seed)  # the same draw as lm_training.train's: the weights training started from
    init = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    init.to(device).eval()
    losses["init"] = mean_loss(init, short, 8, device)
    activations = {
        "windows": len(stats), "window": EVAL_WINDOW,
        # attention entropy of a uniform causal distribution, averaged over query positions, for scale
        "uniform_attn_entropy": sum(math.log(t + 1) for t in range(EVAL_WINDOW)) / EVAL_WINDOW,
        "reference": activation_stats(load(out, device, "eager"), stats, device),
        "init": activation_stats(init, stats, device),
        "builtin": activation_stats(load(modelzoo.SHIPPED_MODEL, device, "eager"), stats, device),
    }
    return {"heldout_loss": losses, "activations": activations}


# -----------------------------------------------------------------------------


def main(argv=None):
    args = parse_args(argv)
    size = SIZES[args.size]
    device = resolve_device(args.device)
    out = args.out.expanduser().absolute()
    check_out(out, args.overwrite, REPORT)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    torch.set_float32_matmul_precision("highest")  # no TF32: FP32 means FP32 (the default, stated)

    config = make_config(size)
    tokenizer = modelzoo.build_tokenizer(model_max_length=config.max_position_embeddings)
    t = time.perf_counter()
    heldout_files = heldout_modules()
    heldout_texts = [f.read_text(encoding="utf-8") for f in heldout_files]
    files, corpus = gather_corpus(args.corpus_bytes, {hashlib.sha256(x.encode()).hexdigest() for x in heldout_texts})
    if not files:
        fail(f"no source file fits in --corpus-bytes {args.corpus_bytes}; raise it")
    train_stream = encode([text for _, _, text in files], tokenizer)
    heldout = encode(heldout_texts, tokenizer)[: size.eval_tokens]
    names_sha, contents_sha = corpus_hashes([(name, path) for name, path, _ in files])
    corpus.update({"files": len(files), "bytes": sum(len(text.encode()) for _, _, text in files),
                   "tokens": len(train_stream), "cap_bytes": args.corpus_bytes, "names_sha256": names_sha,
                   "contents_sha256": contents_sha, "first": files[0][0], "last": files[-1][0],
                   "heldout_files": [f.name for f in heldout_files], "heldout_tokens_scored": len(heldout)})
    prep_s = time.perf_counter() - t
    print(f"corpus: {len(files):,} files, {corpus['bytes']:,} bytes, {len(train_stream):,} tokens "
          f"({files[0][0]} .. {files[-1][0]}); held out: {len(heldout_files)} stdlib modules; {prep_s:.0f}s",
          flush=True)
    if len(train_stream) < size.batch_tokens:
        fail(f"the corpus has {len(train_stream)} tokens, fewer than one step's {size.batch_tokens}; "
             "raise --corpus-bytes")

    long_cost = flops_per_token(config, args.long_seq_len) / flops_per_token(config, args.seq_len)
    model, log, evals, final = train(
        args, config, train_stream, heldout, val_tokens=size.eval_tokens, device=device, amp=size.amp,
        micro_batch_tokens=size.micro_batch_tokens, budget_s=None if args.steps else args.minutes * 60,
        long_cost=long_cost)
    params = sum(p.numel() for p in model.parameters())
    steps = final["steps"]
    long_from = final["long_from"]
    tokens = size.batch_tokens * steps
    flops = (flops_per_token(config, args.seq_len) * long_from
             + flops_per_token(config, args.long_seq_len) * (steps - long_from)) * size.batch_tokens
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    report = {}

    def fill(tmp: Path) -> None:
        save(model, tokenizer, tmp)
        report.update({
            "command": ["scripts/train_reference_model.py", "--size", args.size, "--steps", str(steps), "--seed",
                        str(args.seed), "--corpus-bytes", str(args.corpus_bytes), "--device", str(device)],
            "model": {"params": params, "layers": config.num_hidden_layers, "hidden_size": config.hidden_size,
                      "heads": config.num_attention_heads, "kv_heads": config.num_key_value_heads,
                      "head_dim": config.head_dim, "intermediate_size": config.intermediate_size,
                      "vocab_size": config.vocab_size, "tie_word_embeddings": config.tie_word_embeddings,
                      "train_gflop_per_token": flops_per_token(config, args.seq_len) / 1e9},
            "recipe": asdict(size) | {"steps": steps, "minutes": args.minutes, "seed": args.seed, "weight_decay": args.weight_decay,
                                      "precision": "FP32 master weights, BF16 autocast" if size.amp else "FP32",
                                      "deterministic": True},
            "corpus": corpus,
            "train": {"tokens": tokens, "long_from": long_from, "epochs_short": final["epochs_short"],
                      "epochs_long": final["epochs_long"], "final_train_loss": final["train_loss"],
                      "final_val_loss": final["val_loss"], "log": [{k: v for k, v in row.items() if k != "elapsed_s"}
                                                                   for row in log],
                      "evals": evals},
            "environment": {"device": device_name, "torch": torch.__version__, "cuda": torch.version.cuda,
                            "transformers": transformers.__version__, "python": platform.python_version(),
                            "threads": args.threads},
            # the only part a rerun changes: how long things took
            "timing": {"prepare_s": prep_s, "train_s": final["wall_s"], "calibration": final["calibration"],
                       "train_tflop_per_s": flops / final["wall_s"] / 1e12},
        })
        report.update(evaluate(tmp, config, args.seed, device, heldout, train_stream, size))
        (tmp / REPORT).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        (tmp / REPORT).chmod(0o644)

    write_folder(out, fill)
    h = report["heldout_loss"]
    print(f"wrote {out}: {params:,} parameters, {steps} steps, {tokens:,} tokens in {final['wall_s']:.0f}s "
          f"({report['timing']['train_tflop_per_s']:.1f} TFLOP/s)")
    print(f"held-out loss ({h['tokens_scored']:,} tokens, {EVAL_WINDOW}-token windows): "
          f"reference {h['reference']:.4f}, init {h['init']:.4f}, "
          f"built-in {h['builtin']:.4f}, unigram {h['unigram']:.4f}, uniform {h['uniform']:.4f}")
    print("layer  max|h|/median|h| (reference, init, built-in)  attention entropy (reference, init)")
    a = report["activations"]
    for k, row in enumerate(a["reference"]):
        b = f"{a['builtin'][k]['max_over_median']:9.1f}" if k < len(a["builtin"]) else f"{'-':>9}"  # 4 layers
        print(f"{k:5d}  {row['max_over_median']:9.1f} {a['init'][k]['max_over_median']:9.1f} {b}  "
              f"{row['attn_entropy']:6.3f} {a['init'][k]['attn_entropy']:6.3f}")
    return report


if __name__ == "__main__":
    main()
