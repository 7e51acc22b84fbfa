"""Routing on the tiny Qwen3-MoE: routing.csv and the token/summary columns against a recomputation from
router-logit taps captured outside the tool's routing code, the engine's routes checked, routing replay (R3 and
ids+weights) reaching the trainer's experts for every token and layer while routing.csv still shows the router
disagreement, generate mode and ablate with the routing region, and what routing refuses in one line.

The vLLM runs happen once, in a subprocess (tests/moe_routing_runs.py: one engine for all of them).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

import divergence_probe as dp
from divergence_probe.numerics import routing
from divergence_probe.errors import ProbeError
from divergence_probe.models import get_family
from divergence_probe.spec import LoadSpec, check_family, spec_from_flat

pytestmark = pytest.mark.engine  # every test here starts an engine or runs the tool in a child

TOP_K, LAYERS = 4, 2  # the tiny MoE preset
HELPERS = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def runs(qwen3_moe_tiny, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("moe-routing")
    done = subprocess.run([sys.executable, str(HELPERS / "moe_routing_runs.py"), str(qwen3_moe_tiny), str(out)],
                          capture_output=True, text=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def _csv(run: Path, name: str) -> pd.DataFrame:
    return pd.read_csv(run / name)


def _recomputed(runs: Path) -> list[routing.LayerRouting]:
    """Per layer, the routing of every prompt's rows in prompt order, from the script's own capture of the router
    logits and of the expert ids each stack's router returned."""
    saved = torch.load(runs / "shipped" / "taps.pt")
    taps, ids, prompts = saved["taps"], saved["ids"], sorted(saved["lengths"])

    def rows(store, side, layer):
        return torch.cat([store[(side, p, layer)] for p in prompts])

    return [routing.compare_layer(rows(taps, "infer", layer), rows(taps, "train", layer), TOP_K,
                                  infer_ids=rows(ids, "infer", layer), train_ids=rows(ids, "train", layer))
            for layer in range(LAYERS)]


def test_frac_experts_differ_is_the_experts_each_stack_ran(runs):
    """frac_experts_differ against a plain count of the ids the two routers returned (the script's own capture:
    the trainer's from a hook on each transformers router), and never below the logit-based count: a token whose
    logits' strict order differs runs through other experts whatever the tie-breaks."""
    saved = torch.load(runs / "shipped" / "taps.pt")
    ids, prompts = saved["ids"], sorted(saved["lengths"])
    table = _csv(runs / "shipped", "routing.csv")
    for layer in range(LAYERS):
        a, b = (torch.cat([ids[(side, p, layer)] for p in prompts]) for side in ("infer", "train"))
        differ = [set(x) != set(y) for x, y in zip(a.tolist(), b.tolist())]
        row = table.iloc[layer]
        assert row.frac_experts_differ == pytest.approx(sum(differ) / len(differ), rel=1e-12), layer
        assert row.frac_experts_differ >= row.frac_topk_set_differs
        assert row.frac_experts_differ == pytest.approx(row.frac_differ_strict_order + row.frac_differ_tie_collision)
    manifest = json.loads((runs / "shipped" / "manifest.json").read_text())["compare"]["routing"]
    assert manifest["expert_ids_recorded"] == {"infer": True, "train": True} and "experts_not_compared" not in manifest


def test_routing_csv_equals_a_recomputation_from_the_taps(runs):
    table = _csv(runs / "shipped", "routing.csv")
    assert list(table.layer) == list(range(LAYERS))
    for layer, r in enumerate(_recomputed(runs)):
        expected = routing.layer_metrics(r)
        row = table.iloc[layer]
        for column, value in expected.items():
            assert (math.isnan(value) and math.isnan(row[column])) or row[column] == pytest.approx(value, rel=1e-12), \
                (layer, column)
    assert table.frac_topk_set_differs.max() > 0  # the tiny MoE does flip: the replay tests below mean something


def test_token_columns_and_summary_equal_the_recomputation(runs):
    saved = torch.load(runs / "shipped" / "taps.pt")
    lengths = saved["lengths"]
    flips, first = routing.token_flips(_recomputed(runs))
    tokens = _csv(runs / "shipped", "tokens.csv")
    start = 0
    for prompt in sorted(lengths):
        n = lengths[prompt]
        rows = tokens[tokens.prompt_id == prompt].sort_values("position")
        assert list(rows.position) == list(range(1, n))
        assert list(rows.routing_flips) == flips[start + 1 : start + n].tolist()  # at the token's own position
        assert list(rows.first_flip_layer) == first[start + 1 : start + n].tolist()
        upstream = (torch.cumsum((flips[start : start + n - 1] > 0).long(), 0) > 0).tolist()
        assert list(rows.upstream_flip) == upstream
        start += n
    summary = _csv(runs / "shipped", "summary.csv").iloc[0]
    assert summary.frac_tokens_any_flip == pytest.approx(routing.frac_tokens_any_flip(flips), rel=1e-12)
    assert summary.frac_tokens_upstream_flip == pytest.approx(tokens.upstream_flip.mean(), rel=1e-12)
    assert summary.mean_abs_dlogp_upstream_flip == pytest.approx(
        tokens.delta_logprob.abs()[tokens.upstream_flip].mean(), rel=1e-12)


def test_engine_routes_checked_for_every_token_and_layer(runs):
    manifest = json.loads((runs / "shipped" / "manifest.json").read_text())
    saved = torch.load(runs / "shipped" / "taps.pt")
    assert manifest["compare"]["routing"]["engine_routes_checked_token_layers"] == \
        sum(saved["lengths"].values()) * LAYERS
    assert manifest["stacks"]["train"]["implementations"]["experts"]


def test_routing_noise_floors_beside_the_flip_rate(runs):
    """Each stack batched vs alone, and the trainer under kernel_noise's change of SDPA kernel (its kernel floor for
    routing, labelled as kernel_noise.csv labels the change), one row per layer, each summarised in summary.csv."""
    floor = _csv(runs / "shipped", "routing_noise.csv")
    batched = floor[floor.change == "batched vs alone"]
    assert set(batched.side) == {"infer", "train"} and set(batched.layer) == set(range(LAYERS))
    [kernel_change] = _csv(runs / "shipped", "kernel_noise.csv").change
    kernel = floor[floor.change == kernel_change]
    assert set(kernel.side) == {"train"} and sorted(kernel.layer) == list(range(LAYERS))
    assert len(floor) == len(batched) + len(kernel)
    assert (kernel.tokens == batched[batched.side == "train"].tokens.to_numpy()).all()
    summary = _csv(runs / "shipped", "summary.csv").iloc[0]
    for side in ("infer", "train"):
        assert summary[f"noise_{side}_frac_topk_set_differs"] == pytest.approx(
            batched[batched.side == side].frac_topk_set_differs.mean())
    assert summary["noise_train_kernel_frac_topk_set_differs"] == pytest.approx(kernel.frac_topk_set_differs.mean())
    assert summary["noise_train_kernel_frac_tokens_any_flip"] == kernel.frac_tokens_any_flip.iloc[0]
    assert summary["noise_train_kernel_frac_experts_differ"] == pytest.approx(kernel.frac_experts_differ.mean())
    assert floor.frac_experts_differ.notna().all() and (floor.frac_experts_differ >= floor.frac_topk_set_differs).all()


def test_the_routing_verdict_reads_every_floor(runs):
    """The cross-stack flip rate against the largest routing floor, the trainer's kernel floor among them: in
    summary.csv and in the printed table."""
    from rich.table import Table

    from divergence_probe.cli.tables import routing_rows
    from divergence_probe.numerics.tables import ROUTING_NOISE_FLOORS

    s = _csv(runs / "shipped", "summary.csv").iloc[0].to_dict()
    floors = {name: s[name] for name in ROUTING_NOISE_FLOORS}
    assert "noise_train_kernel_frac_tokens_any_flip" in floors and not any(math.isnan(v) for v in floors.values())
    largest = max(floors, key=floors.get)
    assert s["routing_largest_noise_floor"] == largest
    assert s["frac_tokens_any_flip_over_largest_floor"] == pytest.approx(s["frac_tokens_any_flip"] / floors[largest])
    table = Table()
    table.add_column("metric")
    table.add_column("value")
    routing_rows(table, s, False)
    printed = dict(zip(table.columns[0]._cells, table.columns[1]._cells))
    for name, change in ROUTING_NOISE_FLOORS.items():
        assert printed[f"routing noise floor: {change}"] == f"{s[name]:.2%}"
    assert printed["routed differently / largest routing floor"].startswith(
        f"{s['frac_tokens_any_flip_over_largest_floor']:.3g}x ({ROUTING_NOISE_FLOORS[largest]}")


@pytest.mark.parametrize("name", ["r3", "ids_weights"])
def test_replay_sends_every_token_to_the_engines_experts(runs, name):
    """The trainer's experts were called, for every sequence and layer, with exactly the ids the engine's router
    returned for it; those ids are a top-k of the engine's router logits, and where the stacks' routes differ
    (layer 0, whose router input replay cannot change) they are not a top-k of the trainer's own."""
    replay = torch.load(runs / name / "replay.pt")
    handed, calls = replay["handed"], replay["calls"]
    saved = torch.load(runs / "shipped" / "taps.pt")
    prompts = sorted(saved["lengths"])
    overridden = 0
    for layer in range(LAYERS):
        assert len(calls[layer]) == len(prompts)  # one trainer forward per prompt, in prompt order
        for prompt, (ids, weights) in zip(prompts, calls[layer]):
            engine_ids, engine_weights = handed[(prompt, layer)]
            assert torch.equal(ids, engine_ids)
            assert routing.is_admissible_topk(saved["taps"][("infer", prompt, layer)], ids).all()
            if name == "ids_weights":
                assert torch.equal(weights, engine_weights.to(weights.dtype))
            if layer == 0:
                overridden += int((~routing.is_admissible_topk(saved["taps"][("train", prompt, 0)], ids)).sum())
    shipped = _csv(runs / "shipped", "routing.csv")
    # every flip is overridden; a token whose sets differ only by the engine's tie-break may be too
    assert overridden >= round(shipped.frac_topk_set_differs[0] * shipped.tokens[0]) > 0


def test_replay_leaves_the_router_disagreement_visible(runs):
    """Replay changes which experts run, not the router's logits: layer 0's logit columns are the shipped run's,
    while the experts the two stacks ran agree on every token of every layer (the trainer ran the engine's)."""
    shipped, r3 = _csv(runs / "shipped", "routing.csv"), _csv(runs / "r3", "routing.csv")
    logits = [c for c in shipped.columns if c not in ("frac_experts_differ", "frac_differ_strict_order",
                                                       "frac_differ_tie_collision")]
    pd.testing.assert_series_equal(shipped.iloc[0][logits], r3.iloc[0][logits])
    assert shipped.frac_experts_differ[0] > 0 and (r3.frac_experts_differ == 0).all()
    assert _csv(runs / "r3", "summary.csv").frac_tokens_any_flip[0] == 0
    manifest = json.loads((runs / "r3" / "manifest.json").read_text())
    assert manifest["compare"]["routing"]["replay"] == "ids"
    assert json.loads((runs / "ids_weights" / "manifest.json").read_text())["compare"]["routing"]["replay"] == \
        "ids+weights"


def test_generate_mode_replays_routes(runs):
    tokens = _csv(runs / "generate_r3", "tokens.csv")
    last = tokens.groupby(["prompt_id", "sample_id"]).position.transform("max") == tokens.position
    assert tokens.routing_flips[last].isna().all()  # the engine never ran a sample's last token
    assert tokens.routing_flips[~last].notna().all()
    assert "frac_tokens_any_flip" in _csv(runs / "generate_r3", "summary.csv")
    local = _csv(runs / "generate_r3", "local.csv")  # grafted on the sampled sequences, under routing replay
    assert local.local_rel_l2.map(math.isfinite).all() and {"router", "experts"} <= set(local.family)
    assert _csv(runs / "generate_r3", "local_routing.csv").tokens.sum() == \
        _csv(runs / "generate_r3", "routing.csv").tokens.sum()


def test_ablate_attributes_to_routing(runs):
    attribution = _csv(runs / "ablate", "attribution.csv")
    assert set(attribution.region) >= {"rope", "routing"}
    assert len(_csv(runs / "ablate", "ablation.csv")) == 4
    assert set(_csv(runs / "ablate", "routing.csv").combo) == set(_csv(runs / "ablate", "ablation.csv").combo)


@pytest.fixture(scope="module")
def hf_moe(qwen3_moe_tiny):
    """Two transformers instances of the tiny MoE."""
    with dp.load(str(qwen3_moe_tiny), infer="hf", dtype="bfloat16", device="cpu") as probe:
        yield probe


@pytest.fixture(scope="module")
def hf_runs(hf_moe, prompts_file):
    """A grafted compare with depth, and one with the "engine's" routes replayed."""
    plain = hf_moe.compare(prompts=str(prompts_file), graft=True, depth=True)
    replayed = hf_moe.compare(prompts=str(prompts_file), taps="router_logits", align="routing")
    return plain, replayed


def test_replaying_the_trainers_own_routes_changes_nothing(hf_runs):
    """Two transformers instances: the "engine" side's routes are the trainer's own, so replaying them must give the
    trainer's logits bit for bit. This pins the replay's gate weights to transformers' own formula."""
    plain, replayed = hf_runs
    assert replayed.summary["mean_abs_dlogp"] == 0.0
    pd.testing.assert_frame_equal(plain.tokens_table, replayed.tokens_table)


# ------------------------------------------------------------------------------------------------ graft and depth
def test_graft_on_the_same_stack_is_the_forward_bitwise(hf_runs):
    """Two transformers instances: every MoE seam's replay on the other instance's inputs (the experts on its
    routes) is that instance's forward op, so every local error, local routing flip and depth point is zero."""
    files = hf_runs[0].files()
    local = files["local.csv"]
    assert set(zip(local.tap, local.layer)) >= {(t, i) for t in ("router_logits", "mlp_out") for i in range(LAYERS)}
    assert set(local[local.tap == "router_logits"].family) == {"router"}
    assert set(local[local.tap == "mlp_out"].family) == {"experts"}
    assert (local.local_frac_equal == 1).all() and (local.local_rel_l2 == 0).all()
    assert {"router", "experts"} <= set(files["local_families.csv"].family)
    assert list(files["local_routing.csv"].layer) == list(range(LAYERS))
    assert (files["local_routing.csv"].frac_topk_set_differs == 0).all()
    depth = files["depth.csv"]
    assert list(depth.layer) == list(range(LAYERS + 2)) and (depth.mean_abs_dlogp == 0).all()


def test_moe_seams_depend_only_on_their_inputs(hf_moe, prompts_file):
    """The router and experts seams read only what local.seam_inputs names (the experts: post_norm and the engine's
    routes): with every other tap NaN (ids: -1), the same bits; and the experts follow the routes they are handed."""
    from divergence_probe.runs.graft import seam_inputs
    from divergence_probe.prompts import load_prompts
    from divergence_probe.taps import ALL_TAPS, ROUTE_RECORDS, TapKey

    [prompt] = load_prompts(prompts_file, hf_moe.tokenizer, num_prompts=1, max_model_len=2048)
    taps = {}
    hf_moe.infer.score([prompt], frozenset(ALL_TAPS + ROUTE_RECORDS), lambda pid, key, x: taps.__setitem__(key, x))
    layer_taps = hf_moe.source.family.layer_taps
    clean = hf_moe.train.replay(taps)
    embed = TapKey.of("embed", -1)  # shape and dtype of the context
    for name in ("router_logits", "mlp_out"):
        key = TapKey.of(name, 1)
        keep = set(seam_inputs(key, LAYERS, layer_taps)) | {embed}
        poisoned = {k: v if k in keep else torch.full_like(v, float("nan") if v.is_floating_point() else -1)
                    for k, v in taps.items()}  # an expert id of -1: no expert
        assert torch.equal(hf_moe.train.replay(poisoned)[key], clean[key]), name
    ids = TapKey.of("expert_ids", 1)
    rerouted = {**taps, ids: torch.roll(taps[ids], 1, dims=0)}  # every token sent to another token's experts
    assert not torch.equal(hf_moe.train.replay(rerouted)[TapKey.of("mlp_out", 1)], clean[TapKey.of("mlp_out", 1)])


def test_replay_checks_every_layers_routes_with_one_host_read_per_forward(hf_moe, prompts_file):
    """The replay's row checks (k distinct experts in every row) are read back once per forward, not once per layer:
    a replayed forward reads values to the host exactly once more than a plain one (counted at every torch call that
    does: item, tolist, bool, ...). Its refusals stay what they were: the first bad layer, in one line."""
    from torch.overrides import TorchFunctionMode

    from divergence_probe.errors import StackError
    from divergence_probe.prompts import load_prompts

    T = torch.Tensor
    reads = {T.item, T.tolist, T.__bool__, T.__int__, T.__float__, T.__index__, T.nonzero, torch.nonzero, T.cpu,
             T.numpy}

    class HostReads(TorchFunctionMode):
        count = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.count += func in reads
            return func(*args, **(kwargs or {}))

    [prompt] = load_prompts(prompts_file, hf_moe.tokenizer, num_prompts=1, max_model_len=2048)
    stack, own = hf_moe.train, {}
    stack.score([prompt], frozenset({"expert_ids"}), lambda pid, key, x: own.__setitem__(key.layer, x.clone()))
    assert len(own) == LAYERS

    def forward(routes=None) -> int:
        with HostReads() as host:
            if routes is None:
                stack.score([prompt], frozenset(), lambda *_: None)
            else:
                with stack.routes_replayed(lambda key, layer: (routes[layer], None)):
                    stack.score([prompt], frozenset(), lambda *_: None)
        return host.count

    assert forward(own) == forward() + 1
    torn = {**own, 1: own[1].clone()}
    torn[1][3, 1] = torn[1][3, 0]  # one row of layer 1 names an expert twice
    with pytest.raises(StackError, match=f"routes of layer 1 for prompt {prompt.prompt_id} are not {TOP_K} distinct "
                                         "experts of 32 in every row"):
        forward(torn)
    with pytest.raises(StackError, match="routes of layer 0 "):  # the first bad layer is named
        forward({layer: torch.zeros_like(ids) for layer, ids in own.items()})
    assert forward(own) == forward() + 1  # a refused forward leaves nothing behind


def test_graft_separates_the_routers_from_the_experts(runs, qwen3_moe_tiny):
    """vLLM: local_routing.csv is the trainer's router on the engine's own router input against the engine's top-k,
    recomputed here from the engine's post_norm taps and the checkpoint's gate weights (under the trainer's torch
    state); every seam's local error is finite, and the router's propagated error is its layers.csv row."""
    from safetensors.torch import load_file

    from divergence_probe.engines.torch_state import trainer_numerics

    saved = torch.load(runs / "shipped" / "taps.pt")
    prompts = sorted(saved["lengths"])
    weights = {}
    for shard in qwen3_moe_tiny.glob("*.safetensors"):
        weights |= load_file(shard)
    table = _csv(runs / "shipped", "local_routing.csv")
    assert list(table.layer) == list(range(LAYERS))
    with trainer_numerics():
        for layer in range(LAYERS):
            gate = weights[f"model.layers.{layer}.mlp.gate.weight"]
            train = torch.cat([torch.nn.functional.linear(saved["post_norm"][(p, layer)], gate) for p in prompts])
            infer = torch.cat([saved["taps"][("infer", p, layer)] for p in prompts])
            expected = routing.layer_metrics(routing.compare_layer(infer, train, TOP_K))
            row = table.iloc[layer]
            for column, value in expected.items():
                assert (math.isnan(value) and math.isnan(row[column])) or \
                    row[column] == pytest.approx(value, rel=1e-12), (layer, column)
    local = _csv(runs / "shipped", "local.csv")
    assert local.local_rel_l2.map(math.isfinite).all()
    assert (local.local_rel_l2 > 0).any()  # the stacks do differ somewhere locally
    assert {"router", "experts"} <= set(_csv(runs / "shipped", "local_families.csv").family)
    assert (local[local.tap == "router_logits"].propagated_rel_l2.to_numpy() ==
            _csv(runs / "shipped", "layers.csv").query("tap == 'router_logits'").sort_values("layer").rel_l2.to_numpy()
            ).all()


def test_depth_starts_at_the_runs_own_gap(runs):
    """Grafted at the embedding, the trainer's forward (its own router included) is the ungrafted one."""
    depth = _csv(runs / "shipped", "depth.csv")
    summary = _csv(runs / "shipped", "summary.csv").iloc[0]
    assert list(depth.layer) == list(range(LAYERS + 2))
    assert depth.mean_abs_dlogp[0] == summary.mean_abs_dlogp and depth.mean_kl[0] == summary.mean_kl
    assert depth.max_abs_dlogp[0] == summary.max_abs_dlogp and depth.n_tokens[0] == summary.n_tokens


def test_moe_graft_report_renders(runs, tmp_path):
    from divergence_probe.reports import write_report

    report = write_report(runs / "shipped", tmp_path / "report")
    assert "local_vs_propagated.pdf" in {p.name for p in (report.parent / "figures").iterdir()}
    assert "local: frac_topk_set_differs" in report.read_text()  # the local flip rate beside the propagated one


@pytest.mark.parametrize("options, message", [
    ({"align": "routing", "side": "infer"}, "routing is replayed from the engine into the trainer"),
    ({"routing_replay": "ids+weights"}, "--routing-replay applies to the routing region only"),
    ({"align": "routing", "depth": True}, "--depth continues the trainer's forward with its own router"),
])
def test_routing_options_refused_in_one_line(options, message):
    with pytest.raises(ProbeError, match=message):
        spec_from_flat("compare", load=LoadSpec(model="m"), **options)


@pytest.mark.parametrize("arch, kind, options, message", [
    ("qwen3", "compare", {"align": "routing"}, "region routing does not exist in qwen3 models"),
    ("qwen3_moe", "ablate", {}, "region swiglu does not exist in qwen3_moe models"),
])
def test_regions_a_family_lacks_refused_before_loading(arch, kind, options, message):
    spec = spec_from_flat(kind, load=LoadSpec(model="m"), **options)
    with pytest.raises(ProbeError, match=message) as e:
        check_family(spec, spec.load, get_family(arch))
    assert "\n" not in str(e.value)


def test_engine_routes_that_are_not_its_top_k_stop_the_run_in_one_line():
    """An engine whose recorded experts are not a top-k of its own router logits (what an RL framework would replay
    is then not what its router computed) is a one-line error naming sequence, layer and token."""
    from divergence_probe.runs.capture import TapPairing
    from divergence_probe.runs.route_capture import RouteCapture, RouteRecordError
    from divergence_probe.taps import TapKey

    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0], [1.0, 2.0, 3.0, 4.0]], dtype=torch.bfloat16)
    router = TapKey.of("router_logits", 0)
    capture = RouteCapture(TapPairing([router]), num_layers=1, top_k=2, metrics=True, records=True)
    capture.park(7, router, logits)
    capture.pair(7, router, logits)
    capture.park(7, TapKey.of("expert_ids", 0), torch.tensor([[0, 1], [3, 1]]))  # token 1's top-2 is {2, 3}
    capture.park(7, TapKey.of("expert_weights", 0), torch.ones(2, 2))
    with pytest.raises(RouteRecordError) as e:
        capture.finish_prompt(7)
    assert "token 1 of sequence 7 in layer 0" in str(e.value) and "\n" not in str(e.value)


def test_ablate_replays_weights_only_in_combinations_with_routing():
    """--routing-replay ids+weights applies to the combinations that align routing; the others (the shipped one
    included) are plain compares, which a replay option would make invalid."""
    from divergence_probe.runs.ablate import combo_spec
    from divergence_probe.numerics.shapley import subsets

    spec = spec_from_flat("ablate", load=LoadSpec(model="m"), regions="rope,routing", routing_replay="ids+weights")
    replays = {combo: combo_spec(spec, combo).align.routing_replay for combo in subsets(spec.ablate.regions)}
    assert {c: r for c, r in replays.items() if "routing" in c} and \
        all(r == ("ids+weights" if "routing" in c else "ids") for c, r in replays.items())
