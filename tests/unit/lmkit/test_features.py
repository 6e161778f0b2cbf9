"""The hidden states a captured target keeps for feature drafters (``--graph-feature-layers``)."""

from __future__ import annotations

import pytest

from specsplit.lmkit.features import common_layers, eagle3_layers, parse_layers

pytestmark = pytest.mark.unit


def test_auto_keeps_eagle3s_layers_and_the_final_output():
    assert eagle3_layers(32) == (2, 16, 29)
    assert common_layers(32) == (2, 16, 29, 32)
    assert common_layers(2) == (0, 1, 2)  # a tiny model: the layers coincide
    assert parse_layers("auto", 32) == (2, 16, 29, 32)
    assert parse_layers("none", 32) == () == parse_layers("", 32)
    assert parse_layers("32, 0,16,0", 32) == (0, 16, 32)


@pytest.mark.parametrize("value, message", [("33", r"\[33\]: this model's hidden states are 0 \(the embeddings\) to 32"),
                                            ("-1", "hidden states are 0"), ("last", "takes auto, none or comma")])
def test_bad_values_say_what_to_give(value, message):
    with pytest.raises(ValueError, match=message):
        parse_layers(value, 32)
