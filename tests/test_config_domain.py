"""E0432: config values outside what the model's code runs (dsl/resolve/config_domain.py).

Found by the config fuzz (docs/config_fuzz.md): each passed check and crashed every worker."""

from __future__ import annotations

import math

import pytest

from ppdsl.dsl.resolve.config_domain import config_domain_problems


def keys(config: dict, classification: bool = False) -> list[str]:
    return [k for k, _, _ in config_domain_problems(config, {}, classification)]


@pytest.mark.parametrize("value", [-0.1, 1.5, 65536.0, 1e300, math.nan, [0.1, 2.0], (0.0, -1)])
def test_dropout_rate_outside_unit_interval(value: object) -> None:
    for key in ("attention_dropout", "hidden_dropout_prob", "resid_pdrop", "layerdrop", "drop_path_rate"):
        assert keys({key: value}) == [key]


@pytest.mark.parametrize("value", [0, 0.0, 1, 1.0, 1e-300, 0.5, None, True, [0.0, 0.1], "0.1"])
def test_rates_in_range_or_not_numbers_pass(value: object) -> None:
    assert keys({"attention_dropout": value, "router_jitter_noise": 1e30, "layer_norm_eps": 10.0}) == []


def test_vocabulary_needs_a_row_and_a_classifier_a_label() -> None:
    assert keys({"vocab_size": 0}) == ["vocab_size"] and keys({"n_vocab": -3}) == ["n_vocab"]
    assert keys({"vocab_size": 1}) == []
    assert keys({"num_labels": 0}, classification=True) == ["num_labels"]
    assert keys({"num_labels": 0}) == []  # a causal LM never reads it
    assert keys({"num_labels": 1}, classification=True) == []  # regression


def test_a_family_key_is_found_before_the_aliases() -> None:
    found = list(config_domain_problems({"padded_vocab": 0, "vocab_size": 64}, {"vocab": ("padded_vocab",)}, False))
    assert [k for k, _, _ in found] == ["padded_vocab"]
