import pytest

from divergence_probe.errors import ProbeError
from divergence_probe.models import get_family
from divergence_probe.tap_selection import parse_tap_selection
from divergence_probe.taps import ALL_TAPS, TapKey, expected_taps

QWEN2_TAPS, QWEN3_TAPS = get_family("qwen2").layer_taps, get_family("qwen3").layer_taps


def test_selection_parsing():
    assert parse_tap_selection("all") == frozenset(ALL_TAPS)
    assert parse_tap_selection("none") == frozenset()
    assert parse_tap_selection("q_rope, logits") == {"q_rope", "logits"}
    with pytest.raises(ProbeError, match="q_rope"):  # the error lists valid names
        parse_tap_selection("qrope")


def test_expected_taps_are_in_forward_order():
    keys = expected_taps(frozenset(ALL_TAPS), num_layers=2, layer_taps=QWEN2_TAPS)
    labels = [k.label for k in keys]
    assert labels[0] == "embed@-1" and labels[-2:] == ["final_norm@2", "logits@2"]
    assert labels.index("resid_out@0") < labels.index("input_norm@1")
    assert labels.index("q_rope@0") < labels.index("attn_core@0") < labels.index("swiglu@0")
    assert not any(k.name in ("q_norm", "k_norm") for k in keys)
    assert len([k for k in keys if k.name == "q_norm"]) == 0
    qwen3 = expected_taps(frozenset(ALL_TAPS), num_layers=2, layer_taps=QWEN3_TAPS)
    assert len(qwen3) == len(keys) + 4
    assert TapKey.of("q_norm", 0) < TapKey.of("q_rope", 0)
