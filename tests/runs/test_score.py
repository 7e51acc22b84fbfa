"""score: rollouts the tool samples itself in generate mode, written in each framework's layout, must score to the
generate run's numbers exactly; hostile rollout files are one line each, exit 2, nothing written."""

from __future__ import annotations

import gzip
import json
import math
import os
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from divergence_probe.cli import app
from divergence_probe.numerics.rl_metrics import log_factors
from divergence_probe.rollouts import RolloutError, read_rollouts
from divergence_probe.runs.score import Scorer, score_batch
from test_compare_cli import assert_nothing_written, assert_one_line_error

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.engine  # every test here starts an engine or runs the tool in a child

GEN = dict(max_new_tokens=8, samples_per_prompt=2, temperature=1.0)
PAD = 0
# columns of tokens.csv that score must reproduce byte for byte (generate's logprob_infer is score's logprob_rollout)
SAME = ["prompt_id", "sample_id", "position", "token_id", "token", "logprob_train", "delta_logprob"]
SUMMARY_SAME = ["mean_abs_dlogp", "max_abs_dlogp", "p99_abs_dlogp", "n_tokens", "std_abs_dlogp", "mean_abs_dp",
                "max_abs_dp", "k1", "k2", "k3", "ratio_mean", "ratio_std", "ratio_min", "ratio_max", "ppo_clip_frac",
                "tis_truncated_frac", "mis_masked_frac", "ess", "n_response_tokens", "seq_mean_abs_logratio",
                "seq_max_abs_logratio", "mean_logppl_diff", "ppl_ratio", "seq_geo_ratio_outside_frac", "n_sequences"]


@pytest.fixture(scope="module")
def generated(vllm_probe, prompts_file, tmp_path_factory):
    """One generate run (vLLM's decode path vs the trainer), written, and its rollouts as plain records."""
    out = tmp_path_factory.mktemp("score") / "generate"
    run = vllm_probe.compare(prompts=prompts_file, taps="none", generate=GEN)
    run.write(out)
    tokens = run.tokens_table
    records = []
    for (pid, sid), rows in tokens[tokens.is_response].groupby(["prompt_id", "sample_id"], sort=True):
        records.append({"group": int(pid), "prompt": list(run.prompts[pid].token_ids),
                        "response": rows.token_id.tolist(), "logprobs": rows.logprob_infer.tolist()})
    return out, records


def _layouts(records):
    """The records in each framework's layout (with the padding their tensors carry, where they pad)."""
    longest_p = max(len(r["prompt"]) for r in records)
    longest_r = max(len(r["response"]) for r in records)
    out = {"generic": [], "verl": [], "openrlhf": [], "slime": [], "trl": []}
    for r in records:
        p, resp, lp = r["prompt"], r["response"], r["logprobs"]
        lpad, rpad = longest_p - len(p), longest_r - len(resp)
        out["generic"].append({"prompt_ids": p, "response_ids": resp, "logprobs": lp, "group": r["group"]})
        prompts, responses = [PAD] * lpad + p, resp + [PAD] * rpad
        out["verl"].append({"prompts": prompts, "responses": responses, "input_ids": prompts + responses,
                            "attention_mask": [0] * lpad + [1] * (len(p) + len(resp)) + [0] * rpad,
                            "rollout_log_probs": lp + [0.0] * rpad, "uid": f"uid-{r['group']}"})
        out["openrlhf"].append({"sequences": prompts + responses,
                                "attention_mask": [0] * lpad + [1] * (len(p) + len(resp)) + [0] * rpad,
                                "action_mask": [1] * len(resp) + [0] * rpad,
                                "rollout_log_probs": lp + [0.0] * rpad, "group": r["group"]})
        out["slime"].append({"tokens": p + resp, "response_length": len(resp), "rollout_log_probs": lp,
                             "group_index": r["group"], "index": len(out["slime"])})
        out["trl"].append({"prompt_ids": prompts, "prompt_mask": [0] * lpad + [1] * len(p), "completion_ids": responses,
                           "completion_mask": [1] * len(resp) + [0] * rpad,
                           "sampling_per_token_logps": lp + [0.0] * rpad, "group": r["group"]})
    return out


def _jsonl(path, rows, gz=False):
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if gz:
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


def _str_csv(path):
    return pd.read_csv(path, dtype=str, keep_default_na=False)


def _assert_same_as_generate(gen_dir, score_dir):
    gen = _str_csv(gen_dir / "tokens.csv")
    gen = gen[gen.is_response == "True"].reset_index(drop=True)
    got = _str_csv(score_dir / "tokens.csv")
    assert len(got) == len(gen) > 0
    for col in SAME:
        assert got[col].tolist() == gen[col].tolist(), col
    assert got.logprob_rollout.tolist() == gen.logprob_infer.tolist()
    gs, ss = (_str_csv(d / "summary.csv").iloc[0] for d in (gen_dir, score_dir))
    for col in SUMMARY_SAME:
        assert ss[col] == gs[col], col
    gb, sb = (_str_csv(d / "buckets.csv") for d in (gen_dir, score_dir))
    assert sb.drop(columns="mean_kl").equals(gb.drop(columns="mean_kl"))


@pytest.mark.parametrize("layout", ["verl", "openrlhf", "slime", "trl", "generic"])
@pytest.mark.parametrize("container", ["jsonl", "parquet"])
def test_score_reproduces_the_generate_run(vllm_probe, generated, tmp_path, layout, container):
    gen_dir, records = generated
    rows = _layouts(records)[layout]
    path = tmp_path / f"rollouts.{container}"
    if container == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        _jsonl(path, rows)
    batch = read_rollouts(path)
    assert batch.format == layout
    run = score_batch(Scorer.of_probe(vllm_probe), batch)
    run.write(tmp_path / "scored")
    _assert_same_as_generate(gen_dir, tmp_path / "scored")
    manifest = json.loads((tmp_path / "scored" / "manifest.json").read_text())
    assert manifest["kind"] == "score" and manifest["score"]["format"] == layout
    assert len(manifest["score"]["rollouts_sha256"]) == 64
    summary = run.summary
    assert not summary["recorded_far"] and summary["likely_cause"] == ""


def test_prefill_splits_the_gap_in_three(vllm_probe, generated, tmp_path):
    """--infer vllm: the engine's prefill of the same sequences sits beside both; its gap to the recorded decode
    logprobs and to the trainer are each reported, and the trainer side is unchanged."""
    gen_dir, records = generated
    batch = read_rollouts(_jsonl(tmp_path / "r.jsonl", _layouts(records)["slime"]))
    run = score_batch(Scorer.of_probe(vllm_probe, prefill=True), batch)
    run.write(tmp_path / "scored")
    _assert_same_as_generate(gen_dir, tmp_path / "scored")
    tokens = pd.read_csv(tmp_path / "scored" / "tokens.csv")
    assert tokens.logprob_prefill.notna().all() and tokens.kl.notna().all() and (tokens.kl >= 0).all()
    s = run.summary
    ref = (tokens.logprob_prefill - tokens.logprob_train).abs().mean()
    assert s["prefill_vs_train_mean_abs_dlogp"] == pytest.approx(ref, rel=1e-12)
    ref = (tokens.logprob_rollout - tokens.logprob_prefill).abs().mean()
    assert s["rollout_vs_prefill_mean_abs_dlogp"] == pytest.approx(ref, rel=1e-12, abs=0)
    assert s["rollout_vs_train_mean_abs_dlogp"] == s["mean_abs_dlogp"] > 0
    assert not s["recorded_far"]
    # the ratio's two factors here (no decode of score's own): they add up to delta_logprob to the bit (float32
    # recordings, as this one), and the larger one is named
    f = log_factors({"train": tokens.logprob_train, "prefill": tokens.logprob_prefill,
                     "recorded": tokens.logprob_rollout})
    assert list(f) == ["train_vs_prefill", "prefill_vs_recorded"]
    assert (f["train_vs_prefill"] + f["prefill_vs_recorded"] == tokens.delta_logprob.to_numpy()).all()
    for name, values in f.items():
        assert s[f"{name}_mean_dlogp"] == values.mean() and f"{name}_mean_abs_dlogp" not in s  # not written twice:
    assert s["prefill_vs_train_mean_abs_dlogp"] == np.abs(f["train_vs_prefill"]).mean()  # their mean |log| are these
    assert s["rollout_vs_prefill_mean_abs_dlogp"] == np.abs(f["prefill_vs_recorded"]).mean()
    assert s["dominant_factor"] == max(f, key=lambda name: np.abs(f[name]).mean())


def _scored_with(vllm_probe, records, tmp_path, change, **options):
    rows = _layouts(records)["generic"]
    for row in rows:
        change(row)
    return score_batch(Scorer.of_probe(vllm_probe), read_rollouts(_jsonl(tmp_path / "r.jsonl", rows)), **options)


def test_far_recordings_name_a_likely_cause(vllm_probe, generated, tmp_path):
    _, records = generated
    base = score_batch(Scorer.of_probe(vllm_probe), read_rollouts(_jsonl(tmp_path / "b.jsonl",
                                                                          _layouts(records)["generic"])))
    # the recording holds the trainer's own logprobs at temperature 0.5: tempered logprobs beside raw ones
    lps = iter(t.logprob_train for t in score_batch(Scorer.of_probe(vllm_probe), base.batch, temperature=0.5).tokens)

    def set_tempered(row):
        row["logprobs"] = [next(lps) for _ in row["logprobs"]]

    s = _scored_with(vllm_probe, records, tmp_path, set_tempered).summary
    assert s["recorded_far"] and s["likely_cause"] == "temperature" and s["fitted_temperature"] == 0.5
    assert s["tempered_mean_abs_dlogp"] == 0
    # every recorded logprob lower than the trainer's by a nat, on the very tokens: other weights
    train = iter(t.logprob_train for t in base.tokens)

    def lowered(row):
        row["logprobs"] = [next(train) - 1.0 for _ in row["logprobs"]]

    s = _scored_with(vllm_probe, records, tmp_path, lowered).summary
    assert s["recorded_far"] and s["likely_cause"] == "stale_weights"


@pytest.fixture(scope="module")
def builtin_scorer():
    """The built-in trained model's training stack alone (no engine): its peaked next-token distributions move
    under a temperature as a trained policy's do."""
    import divergence_probe as dp

    probe = dp.load(None, infer="hf", device="cpu")
    yield Scorer.of_probe(probe), probe.tokenizer
    probe.close()


def test_a_tempered_recording_is_named_as_such_and_scored_at_its_temperature(builtin_scorer, tmp_path):
    """An engine that reports logprobs at the sampling temperature (0.7) beside a trainer's raw ones. Without
    --temperature the diagnosis names a temperature, the one that fits, not stale weights; with --temperature 0.7
    the headline metrics compare at 0.7, where the recording is the trainer's own, and the raw gap stays beside."""
    from divergence_probe.prompts import default_prompts_path

    scorer, tokenizer = builtin_scorer
    text = (default_prompts_path() / "prose.txt").read_text()
    ids = tokenizer(text)["input_ids"]
    rows = [{"prompt_ids": ids[i:i + 24], "response_ids": ids[i + 24:i + 56], "logprobs": [-1.0] * 32}
            for i in (0, 100, 200)]
    trainer_at = score_batch(scorer, read_rollouts(_jsonl(tmp_path / "any.jsonl", rows)), temperature=0.7)
    at = iter(t.logprob_train for t in trainer_at.tokens)
    for row in rows:
        row["logprobs"] = [next(at) for _ in row["logprobs"]]
    batch = read_rollouts(_jsonl(tmp_path / "tempered.jsonl", rows))

    plain = score_batch(scorer, batch).summary
    assert plain["recorded_far"] and plain["likely_cause"] == "temperature", plain
    assert plain["fitted_temperature"] == 0.7 and plain["tempered_mean_abs_dlogp"] == 0

    tempered = score_batch(scorer, batch, temperature=0.7)
    s = tempered.summary
    assert s["mean_abs_dlogp"] == 0 and s["k3"] == 0 and not s["recorded_far"] and s["likely_cause"] == ""
    assert s["untempered_mean_abs_dlogp"] == plain["mean_abs_dlogp"] > s["far_bound"]
    assert [t.logprob_train for t in tempered.tokens] == [t.logprob_train for t in trainer_at.tokens]


HOSTILE = {
    "ragged": ({"prompt_ids": [1, 2], "response_ids": [3, 4, 5], "logprobs": [-1.0, -2.0]}, "ragged"),
    "nan": ({"prompt_ids": [1, 2], "response_ids": [3], "logprobs": [float("nan")]}, "non-finite"),
    "inf": ({"prompt_ids": [1, 2], "response_ids": [3], "logprobs": [float("-inf")]}, "non-finite"),
    "positive": ({"prompt_ids": [1, 2], "response_ids": [3], "logprobs": [0.5]}, "no log-probability"),
    "not_ids": ({"prompt_ids": [1, 2], "response_ids": ["a"], "logprobs": [-1.0]}, "not a list of token ids"),
    "not_continuation": ({"prompts": [1, 2], "responses": [3], "input_ids": [1, 2, 4], "rollout_log_probs": [-1.0]},
                         "continuation"),
    "empty_response": ({"prompt_ids": [1, 2], "response_ids": [], "logprobs": []}, "empty response"),
    "group_of_two_prompts": ([{"prompt_ids": [1, 2], "response_ids": [3], "logprobs": [-1.0], "group": 7},
                              {"prompt_ids": [1, 9], "response_ids": [3], "logprobs": [-1.0], "group": 7}],
                             "has another prompt"),
    "slime_length": ({"tokens": [1, 2], "response_length": 5, "rollout_log_probs": [-1.0]}, "ragged"),
    "huge_int_logprob": ({"prompt_ids": [1, 2], "response_ids": [3], "logprobs": [-10**400]}, "integer of 401 digits"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_rows_are_one_line(tmp_path, name):
    rows, says = HOSTILE[name]
    with pytest.raises(RolloutError, match=says):
        read_rollouts(_jsonl(tmp_path / "r.jsonl", rows if isinstance(rows, list) else [rows]))


def test_hostile_files_are_one_line(tmp_path):
    good = {"prompt_ids": [1, 2], "response_ids": [3], "logprobs": [-1.0]}
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(gzip.compress((json.dumps(good) + "\n").encode() * 200)[:-30])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    not_object = _jsonl(tmp_path / "list.jsonl", [good])
    not_object.write_text(not_object.read_text() + "[1, 2]\n")
    wrong_types = tmp_path / "types.parquet"
    pq.write_table(pa.table({"prompt_ids": ["1 2"], "response_ids": [[3]], "logprobs": [[-1.0]]}), wrong_types)
    unknown = _jsonl(tmp_path / "unknown.jsonl", [{"text": "hi"}])
    verl_too = {"prompts": [1], "responses": [3], "rollout_log_probs": [-1.0]}
    ambiguous = _jsonl(tmp_path / "both.jsonl", [good | verl_too])
    for path, says in ((cut, "cut short"), (empty, "empty"), (not_object, "line 2 is a JSON list"),
                       (wrong_types, "not a list of token ids"), (unknown, "match no known format"),
                       (ambiguous, "several formats"), (tmp_path / "missing.jsonl", "does not exist")):
        with pytest.raises(RolloutError, match=says):
            read_rollouts(path)


def test_ids_that_do_not_fit_the_model(vllm_probe, tmp_path):
    vocab = Scorer.of_probe(vllm_probe).vocab_size
    for row, says in (({"prompt_ids": [1], "response_ids": [vocab], "logprobs": [-1.0]}, "past the model's vocabulary"),
                      ({"prompt_ids": [1] * vllm_probe.settings.max_model_len, "response_ids": [3], "logprobs": [-1.0]},
                       "context")):
        with pytest.raises(RolloutError, match=says):
            score_batch(Scorer.of_probe(vllm_probe), read_rollouts(_jsonl(tmp_path / "r.jsonl", [row])))


def test_score_cli(qwen3_tiny, generated, tmp_path):
    """The command end to end on a fresh trainer (transformers only, no engine): the generate run's numbers; a
    hostile file is one line, exit 2, and no run folder."""
    gen_dir, records = generated
    path = _jsonl(tmp_path / "r.jsonl.gz", _layouts(records)["verl"], gz=True)
    out = tmp_path / "scored"
    result = CliRunner().invoke(app, ["score", str(path), "--model", str(qwen3_tiny), "--device", "cpu",
                                      "--out", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    _assert_same_as_generate(gen_dir, out)
    bad = _jsonl(tmp_path / "bad.jsonl", [{"prompt_ids": [1], "response_ids": [2], "logprobs": [math.inf]}])
    result = CliRunner().invoke(app, ["score", str(bad), "--model", str(qwen3_tiny), "--device", "cpu",
                                      "--out", str(tmp_path / "no")])
    assert_one_line_error(result, "non-finite")
    assert not (tmp_path / "no").exists()


def test_wrong_tokens_are_named_when_they_carry_the_gap(tmp_path):
    """The rule on its own (a tiny random model finds every token unlikely, so no model run can show it): recorded
    logprobs that call likely tokens the model would hardly sample, against a trainer that agrees elsewhere."""
    from divergence_probe.runs.scored import UNLIKELY_LOGPROB, ScoreRun, TokenScore

    def run(train_lp, rec_lp):
        tokens = [TokenScore(0, 1 + j, 5, "x", r, t, math.nan, 0, True)
                  for j, (r, t) in enumerate(zip(rec_lp, train_lp))]
        return ScoreRun(None, [], tokens, None, {}, 0.2, 2.0).diagnosis()

    unlikely = UNLIKELY_LOGPROB - 3
    s = run([-0.1] * 8 + [unlikely] * 2, [-0.1] * 8 + [-0.2] * 2)
    assert s["recorded_far"] and s["likely_cause"] == "wrong_tokens" and s["wrong_token_share"] == 1.0
    s = run([-0.1] * 10, [-0.1] * 10)
    assert not s["recorded_far"] and s["likely_cause"] == ""


def test_fields_name_the_generic_columns(tmp_path):
    row = {"p": [1, 2], "r": [3, 4], "lp": [-1.0, -2.0], "g": "a"}
    batch = read_rollouts(_jsonl(tmp_path / "r.jsonl", [row]), fields="prompt_ids=p,response_ids=r,logprobs=lp,group=g")
    [r] = batch.rollouts
    assert (r.prompt_ids, r.response_ids, r.logprobs, r.group) == ((1, 2), (3, 4), (-1.0, -2.0), "a")
    for fields, says in (("prompt_ids", "NAME=COLUMN"), ("tokens=p", "NAME=COLUMN")):
        with pytest.raises(RolloutError, match=says):
            read_rollouts(tmp_path / "r.jsonl", fields=fields)
    with pytest.raises(RolloutError, match="generic format"):
        read_rollouts(tmp_path / "r.jsonl", "verl", fields="prompt_ids=p")


@pytest.fixture(scope="module")
def scored_cli(vllm_probe, qwen3_tiny, generated, tmp_path_factory):
    """`score --infer vllm` through the CLI on the generate run's rollouts (verl layout): the session's engine serves
    it (the same load settings), so no engine starts."""
    _, records = generated
    root = tmp_path_factory.mktemp("score-cli")
    path = _jsonl(root / "r.jsonl", _layouts(records)["verl"])
    result = CliRunner().invoke(app, ["score", str(path), "--model", str(qwen3_tiny), "--device", "cpu",
                                      "--infer", "vllm", "--out", str(root / "scored")], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return root / "scored"


def test_report_of_a_score_run_shows_the_three_way_split(scored_cli, tmp_path):
    from divergence_probe.reports.document import sig

    result = CliRunner().invoke(app, ["report", str(scored_cli), "--out", str(tmp_path / "report")])
    assert result.exit_code == 0, result.output
    text = (tmp_path / "report" / "report.md").read_text()
    s = pd.read_csv(scored_cli / "summary.csv").iloc[0]
    assert "score run" in text and "## What the run saw" in text and "## First divergence" not in text
    for key in ("rollout_vs_train_mean_abs_dlogp", "prefill_vs_train_mean_abs_dlogp",
                "rollout_vs_prefill_mean_abs_dlogp"):
        assert f" {sig(s[key])} nats" in text, key
    from divergence_probe.reports.wording import FACTORS

    dominant = s["dominant_factor"]
    assert f"the larger factor is {FACTORS[dominant]} (signed mean log {sig(s[dominant + '_mean_dlogp'])} nats)" in text
    assert "within" in text and not s["recorded_far"]  # the tool's own decode path: numerics, not a problem
    assert (tmp_path / "report" / "figures" / "kl_by_position.png").is_file()  # the prefill gives every token a KL


def test_rerun_of_a_score_run_is_byte_identical(scored_cli, tmp_path):
    result = CliRunner().invoke(app, ["rerun", str(scored_cli), "--out", str(tmp_path / "again")],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "rerun: score of" in result.output and "--infer vllm" in result.output
    for name in ("tokens.csv", "summary.csv", "buckets.csv", "prompts.jsonl"):
        assert (tmp_path / "again" / name).read_bytes() == (scored_cli / name).read_bytes(), name


def _edit_manifest(folder, change):
    path = folder / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


def _fifo(m, tmp_path):
    import os

    os.mkfifo(tmp_path / "pipe.jsonl")
    m["score"]["spec"]["rollouts"] = str(tmp_path / "pipe.jsonl")


def _changed(m, copy):
    copy.write_text(copy.read_text() * 2)  # a copy of the rollouts, with every row twice
    m["score"]["spec"]["rollouts"] = str(copy)


SCORE_EDITS = {  # an edited or stale score run folder: what rerun must refuse before anything loads
    "engine_args": (lambda m, _: m["score"]["load_spec"].update(engine_args={"trust_remote_code": True}),
                    "engine_args"),
    "clip_eps_text": (lambda m, _: m["score"]["spec"].update(clip_eps="0.2"), "score.spec.clip_eps"),
    "unknown_field": (lambda m, _: m["score"]["spec"].update(code="x"), "unknown field(s) score.spec.code"),
    "infer_hf": (lambda m, _: m["score"]["spec"].update(infer="hf"), "--infer 'hf'"),
    "no_spec": (lambda m, _: m["score"].pop("spec"), "lacks the recorded score spec"),
    "pipe": (_fifo, "not a regular file"),
    "changed_file": (lambda m, tmp: _changed(m, tmp / "r.jsonl"), "changed since the run was made"),
}


@pytest.mark.parametrize("name", sorted(SCORE_EDITS))
def test_rerun_of_an_edited_score_run_is_one_line(scored_cli, tmp_path, monkeypatch, name):
    import shutil

    from divergence_probe.runs import score as score_module

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded before the refusal")

    monkeypatch.setattr(score_module, "load_scorer", no_load)
    run = Path(shutil.copytree(scored_cli, tmp_path / "run"))
    shutil.copy(json.loads((run / "manifest.json").read_text())["score"]["spec"]["rollouts"], tmp_path / "r.jsonl")
    change, says = SCORE_EDITS[name]
    _edit_manifest(run, lambda m: change(m, tmp_path))
    result = CliRunner().invoke(app, ["rerun", str(run), "--out", str(tmp_path / "again")])
    assert_one_line_error(result, says)
    assert_nothing_written(tmp_path / "again")


def test_rerun_of_a_score_run_on_another_checkpoint_is_one_line(scored_cli, tmp_path):
    """The recorded model's config.json must be the one the run used: refused once the model is resolved, before any
    stack loads (what rerun will run is shown first, on stdout)."""
    import shutil

    run = Path(shutil.copytree(scored_cli, tmp_path / "run"))
    _edit_manifest(run, lambda m: m["model"].update(config_sha256="0" * 64))
    result = CliRunner().invoke(app, ["rerun", str(run), "--out", str(tmp_path / "again")])
    assert result.exit_code == 2 and "rerun: score of" in result.stdout
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "config.json changed" in lines[0], result.stderr
    assert_nothing_written(tmp_path / "again")


# ------------------------------------------------------------------------------------ files small on disk, huge in memory
def _gzip_bomb(path: Path, chunk: bytes, times: int) -> Path:
    """`times` gzip members of `chunk` each (a reader joins them): kilobytes on disk, times x len(chunk) decompressed."""
    member = gzip.compress(chunk)
    with path.open("wb") as f:
        for _ in range(times):
            f.write(member)
    return path


def _sparse(path: Path, size: int) -> Path:
    with path.open("wb") as f:
        f.truncate(size)  # no byte on disk
    return path


def _parquet_bomb(path: Path, values: int) -> Path:
    """One row whose list holds `values` zeros: run-length encoded, a few kB on disk."""
    zeros = pa.array(np.zeros(values, np.int8))
    column = pa.ListArray.from_arrays(pa.array([0, values], pa.int32()), zeros)
    pq.write_table(pa.table({"prompt_ids": column, "response_ids": [[3]], "logprobs": [[-1.0]]}), path)
    return path


ONE_ROW = b'{"prompt_ids": [1, 2, 3, 4, 5, 6, 7, 8], "response_ids": [3], "logprobs": [-1.0]}\n'
# The reader in a process of its own, its bounds set from argv[1] (lowered, so the test stays fast), and an address
# space capped below what reading any of these files whole would take.
READ_CAPPED = """
import json, sys
from divergence_probe.errors import one_line
from divergence_probe.rollouts import RolloutError, read, read_rollouts
for name, value in json.loads(sys.argv[1]).items():
    setattr(read, name, value)
for path in sys.argv[2:]:
    try:
        read_rollouts(path)
        print("read", path)
    except RolloutError as e:
        print(one_line(e))
"""


def test_files_that_expand_in_memory_are_refused_at_a_bound(tmp_path):
    """Each file takes a few MB on disk and GBs read whole: each is refused at the bound it passes, in one line, by a
    reader whose address space is capped at 2 GiB."""
    bounds = {"MAX_ROW_BYTES": 2**20, "MAX_ROWS": 2**10, "MAX_VALUES": 2**16}
    files = {
        "line": (_gzip_bomb(tmp_path / "line.jsonl.gz", b"0" * 2**20, 4096), "line 1 is over 1 MiB"),
        "rows": (_gzip_bomb(tmp_path / "rows.jsonl.gz", ONE_ROW * 2**14, 2**11), "over 1024 rows"),
        "sparse": (_sparse(tmp_path / "sparse.jsonl", 4 * 2**30), "4.0 GiB, over the 1 GiB"),
        "parquet": (_parquet_bomb(tmp_path / "values.parquet", 2**20), "over the 65536 values"),
    }
    cap = 2 * 2**30
    proc = subprocess.run([sys.executable, "-c", READ_CAPPED, json.dumps(bounds), *(str(p) for p, _ in files.values())],
                          text=True, capture_output=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)},
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (cap, cap)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == len(files), proc.stdout
    for line, (name, (path, says)) in zip(lines, files.items()):
        assert str(path) in line and says in line, (name, line)


def test_rows_past_the_decompressed_bound_are_refused(tmp_path, monkeypatch):
    """The bound on a file's decompressed bytes, lowered so that a test file passes it with rows of usual size."""
    from divergence_probe.rollouts import read

    monkeypatch.setattr(read, "MAX_BYTES", 10 * len(ONE_ROW))  # over the gzip file's size on disk
    with pytest.raises(RolloutError, match="GiB of rows once decompressed"):
        read_rollouts(_gzip_bomb(tmp_path / "r.jsonl.gz", ONE_ROW * 11, 1))
    assert len(read_rollouts(_gzip_bomb(tmp_path / "ok.jsonl.gz", ONE_ROW * 10, 1)).rollouts) == 10


def test_a_row_at_the_context_is_refused_before_the_engine_loads(qwen3_tiny, tmp_path, monkeypatch):
    """vLLM keeps one position of the context for the token it samples: a row of exactly max_model_len tokens is
    refused by `score --infer vllm` before any stack loads (compare's prompts have the same limit)."""
    import divergence_probe.runs.loading as loading
    from divergence_probe.models.source import resolve_model

    context = resolve_model(str(qwen3_tiny)).max_model_len
    row = {"prompt_ids": [5] * (context - 1), "response_ids": [6], "logprobs": [-1.0]}
    path = _jsonl(tmp_path / "r.jsonl", [row])
    monkeypatch.setattr(loading, "stack_for", lambda *a, **k: pytest.fail("a stack loaded"))
    result = CliRunner().invoke(app, ["score", str(path), "--model", str(qwen3_tiny), "--device", "cpu",
                                      "--infer", "vllm", "--out", str(tmp_path / "out")])
    assert_one_line_error(result, f"row 0: {context} tokens", f"use at most {context - 1}")
    assert not (tmp_path / "out").exists()


def test_the_recorded_sha256_is_of_the_bytes_read(tmp_path, monkeypatch):
    """A rollout file replaced while score reads it: the batch carries the hash of the rows it holds, never the
    replacement's (which rerun would then accept for a file nobody scored)."""
    import hashlib

    import divergence_probe.rollouts as rollouts

    good = {"prompt_ids": [1, 2], "response_ids": [3], "logprobs": [-1.0]}
    path = _jsonl(tmp_path / "r.jsonl", [good])
    read = hashlib.sha256(path.read_bytes()).hexdigest()
    other = _jsonl(tmp_path / "other.jsonl", [good, good])
    choose = rollouts.choose

    def swapped(*args):  # after the rows were read, before the batch is made
        os.replace(other, path)
        return choose(*args)

    monkeypatch.setattr(rollouts, "choose", swapped)
    batch = read_rollouts(path)
    assert len(batch.rollouts) == 1 and batch.sha256 == read
