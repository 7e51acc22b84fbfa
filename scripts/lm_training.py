"""What the two training scripts share: the corpus of Python sources, its token stream, the seeded batches, the
training loop, and the atomic checkpoint folder.

train_default_model.py (the built-in 1M-parameter model, FP32 on one CPU core) and train_reference_model.py (a
~160M-parameter Qwen3 for the H200, BF16 autocast) differ in shape, corpus size, device and precision, not in how
they train: one loop here, so a fix to it reaches both and the two models stay comparable.
"""

from __future__ import annotations

import hashlib
import math
import os
import platform
import secrets
import shutil
import statistics
import sys
import sysconfig
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from divergence_probe.models import modelzoo# noqa: E402

HOLDOUT_EVERY = 20  # every 20th top-level stdlib file (by sorted name) is the built-in model's validation data
LONG_FRACTION = 0.15  # the last 15% of the steps train on long windows
CALIBRATE = (2, 12)  # --minutes: steps [2, 12) time a step (0 and 1 pay for CUDA's and the allocator's first use)


def fail(message: str) -> None:
    """A mistake the user can fix: one line on stderr and exit code 2, as the divergence-probe CLI does."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


# -----------------------------------------------------------------------------
# data


def stdlib_modules() -> tuple[Path, list[Path]]:
    """The standard library's top-level *.py modules, sorted by name: the built-in model's whole corpus."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return stdlib, sorted(stdlib.glob("*.py"), key=lambda p: p.name)


def heldout_modules() -> list[Path]:
    """The built-in model's validation files: text neither the built-in nor the reference model trains on."""
    return stdlib_modules()[1][::HOLDOUT_EVERY]


def corpus_hashes(named: list[tuple[str, Path]]) -> tuple[str, str]:
    """sha256 of the names (one per line), and of names and contents together (`name\\0sha256(bytes)\\n` each)."""
    names = "".join(f"{name}\n" for name, _ in named).encode()
    contents = hashlib.sha256()
    for name, path in named:
        contents.update(f"{name}\0{hashlib.sha256(path.read_bytes()).hexdigest()}\n".encode())
    return hashlib.sha256(names).hexdigest(), contents.hexdigest()


def encode(texts: list[str], tokenizer) -> torch.Tensor:
    """All texts as one stream of token ids, each followed by <|endoftext|>."""
    eot = tokenizer.convert_tokens_to_ids(modelzoo.ENDOFTEXT)
    parts = []
    for i in range(0, len(texts), 1024):  # in chunks: Python's lists of ids for a whole large corpus would not fit
        parts += [torch.tensor(ids + [eot], dtype=torch.long)
                  for ids in tokenizer(texts[i: i + 1024], add_special_tokens=False, verbose=False)["input_ids"]]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


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


def lr_at(step: int, lr: float, warmup: int, steps: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak. Before `warmup` it does not depend on `steps`,
    which is what lets --minutes fix the step count during the warm-up."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def autocast(device: torch.device, amp: bool):
    """BF16 autocast over FP32 weights (torch AMP), or nothing: FP32 throughout."""
    return torch.autocast(device.type, dtype=torch.bfloat16) if amp else nullcontext()


@torch.no_grad()
def mean_loss(model, data: torch.Tensor, batch: int, device=torch.device("cpu"), amp: bool = False) -> float:
    """Mean next-token loss over equal-length windows (so the mean of window means is the mean over tokens)."""
    was_training = model.training
    model.eval()
    losses = []
    for i in range(0, len(data), batch):
        x = data[i: i + batch].to(device)
        with autocast(device, amp):
            losses.append(model(input_ids=x, labels=x).loss.item())
    model.train(was_training)
    return statistics.fmean(losses)


def train(args, config, train_stream, val_stream, *, val_tokens: int, device=torch.device("cpu"), amp=False,
          micro_batch_tokens: int | None = None, budget_s: float | None = None, long_cost: float = 1.0):
    """Train from `config` on `train_stream`; returns (model, log, evals, final).

    args: steps (None with budget_s: chosen from the measured step time), batch_tokens, seq_len, long_seq_len, lr,
    warmup, weight_decay, seed, log_every, eval_every. micro_batch_tokens splits a step into equal micro-batches whose
    gradients add up (None: one forward per step). budget_s: train for about that long; the step count is fixed
    once, from steps CALIBRATE, before the warm-up ends, so the schedule never changes under a running step and
    `--steps final["steps"]` re-makes the run. long_cost: a long-window step's time over a short one's.
    """
    torch.manual_seed(args.seed)
    # float32 master weights; the BF16 copy is made only when saving
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    model.to(device)
    model.train()
    # nanoGPT's split: decay the matrices (embedding included), not the norm weights
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    fused = device.type == "cuda"  # one kernel per step on the GPU; each element's update is the same arithmetic
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, foreach=False, fused=fused)

    gen = torch.Generator().manual_seed(args.seed)
    phases = {
        "short": Batches(windows(train_stream, args.seq_len), args.batch_tokens // args.seq_len, gen),
        "long": Batches(windows(train_stream, args.long_seq_len), args.batch_tokens // args.long_seq_len, gen),
    }
    val_short = windows(val_stream[:val_tokens], args.seq_len)
    val_long = windows(val_stream[:val_tokens], args.long_seq_len)
    eval_batch = (micro_batch_tokens or args.batch_tokens) // args.seq_len

    steps = args.steps
    if steps is None and args.warmup < CALIBRATE[1]:
        fail(f"--minutes needs a warm-up of at least {CALIBRATE[1]} steps to time steps in; raise --warmup")
    log, evals, window, calibration = [], [], [], None
    t0 = time.perf_counter()
    step, t_cal = 0, None
    while steps is None or step < steps:
        long_from = None if steps is None else steps - int(steps * LONG_FRACTION)
        phase = "long" if long_from is not None and step >= long_from else "short"
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.lr, args.warmup, steps or args.warmup)
        x = phases[phase].next()
        micro = len(x) if micro_batch_tokens is None else max(1, micro_batch_tokens // x.shape[1])
        n_micro = -(-len(x) // micro)
        total = 0.0
        for chunk in x.split(micro):
            chunk = chunk.to(device)
            with autocast(device, amp):
                loss = model(input_ids=chunk, labels=chunk).loss
            if n_micro > 1:
                loss = loss / n_micro
            loss.backward()
            total = total + loss.detach()  # on the device: no wait for the GPU between micro-batches
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        window.append(total.item())
        step += 1
        if budget_s is not None and step == CALIBRATE[0]:
            t_cal = time.perf_counter()
        if budget_s is not None and step == CALIBRATE[1]:
            per_step = (time.perf_counter() - t_cal) / (CALIBRATE[1] - CALIBRATE[0])
            steps = max(CALIBRATE[1] + 1, int(budget_s / (per_step * (1 - LONG_FRACTION + LONG_FRACTION * long_cost))))
            calibration = {"budget_s": budget_s, "s_per_step": per_step, "steps": steps}
            print(f"{budget_s / 60:g} minutes at {per_step:.3f} s/step: {steps} steps; rerun with --steps {steps} "
                  "to re-make this run", flush=True)
        last = steps is not None and step == steps
        if step % args.log_every == 0 or last:
            elapsed = time.perf_counter() - t0
            log.append({"step": step, "phase": phase, "seq_len": x.shape[1], "train_loss": statistics.fmean(window),
                        "lr": lr_at(step - 1, args.lr, args.warmup, steps or args.warmup), "elapsed_s": elapsed})
            window = []
            print(f"step {step:5d}  {phase:5s}  loss {log[-1]['train_loss']:.3f}  lr {log[-1]['lr']:.2e}  "
                  f"{elapsed:6.1f}s  {step / elapsed:.2f} steps/s", flush=True)
        if step % args.eval_every == 0 or last:
            t_eval = time.perf_counter()
            evals.append({"step": step, "val_loss": mean_loss(model, val_short, eval_batch, device, amp)})
            t0 += time.perf_counter() - t_eval  # wall time reported is training time only
            if t_cal is not None and calibration is None:
                t_cal += time.perf_counter() - t_eval
            print(f"step {step:5d}  val loss ({args.seq_len}-token windows) {evals[-1]['val_loss']:.3f}", flush=True)
    wall = time.perf_counter() - t0
    final = {
        "steps": steps,
        "train_loss": log[-1]["train_loss"],
        "val_loss": evals[-1]["val_loss"],
        "val_loss_long": mean_loss(model, val_long, max(1, eval_batch * args.seq_len // args.long_seq_len), device,
                                   amp),
        "epochs_short": phases["short"].epochs, "epochs_long": phases["long"].epochs,
        "long_from": long_from, "wall_s": wall, "calibration": calibration,
    }
    return model, log, evals, final


# -----------------------------------------------------------------------------
# saving, in modelzoo's layout


def save(model, tokenizer, out_dir: Path) -> None:
    config = model.config
    tokenizer.save_pretrained(out_dir)
    model.to("cpu", torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.generation_config = transformers.GenerationConfig(
        # as modelzoo: only the token ids, since vLLM takes sampling defaults from this file too
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
    )
    model.save_pretrained(out_dir, max_shard_size="1000GB")
    for path in out_dir.iterdir():
        path.chmod(0o644)  # safetensors writes 0600; package data must be readable by everyone


def check_out(out: Path, overwrite: bool, marker: str) -> None:
    """--out is free, or (with --overwrite) a folder this script wrote, which holds `marker`."""
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            fail(f"{out} exists and is not empty; pass --overwrite or choose another --out")
        if not (out / marker).is_file():
            fail(f"{out} is not a folder this script wrote (no {marker}); will not overwrite it: choose another --out")


def write_folder(out: Path, fill) -> None:
    """fill(tmp) writes the folder's files into a hidden sibling, which replaces `out` only when complete."""
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    tmp.mkdir(parents=True)
    try:
        fill(tmp)
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


def cpu_name() -> str:
    """The CPU model and whether it has AVX-512: what decides which kernels (and summation orders) torch runs."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine()
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    return f"{name} ({'AVX-512' if 'avx512f' in info else 'no AVX-512'})"
