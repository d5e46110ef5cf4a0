"""max_length: auto (clusterft.modeling.lengths): the quantile of the pool's token lengths,
rounded up to a multiple of 64 and capped, the same for every stage that reads one pool."""

from __future__ import annotations

import pytest

from clusterft.modeling.lengths import (example_lengths, is_auto, resolve_lengths,
                                        resolve_max_length)
from clusterft.modeling.tokenize import encode_example
from clusterft.pipeline.errors import InputError


def test_the_quantile_is_the_order_statistic_rounded_up_and_capped():
    lengths = list(range(1, 101))  # 1..100
    assert resolve_max_length(lengths, 0.99, 1) == 99  # ceil(0.99 * 100) = 99, exactly
    assert resolve_max_length(lengths, 0.5, 1) == 50
    assert resolve_max_length(lengths, 1.0, 1) == 100
    assert resolve_max_length(lengths, 0.01, 1) == 4  # never under encode_example's 4
    assert resolve_max_length(lengths, 0.99) == 128  # rounded up to a multiple of 64
    assert resolve_max_length([64] * 10, 0.99) == 64  # a multiple stays
    assert resolve_max_length(lengths, 0.99, 64, cap=100) == 100
    assert resolve_max_length(reversed(lengths), 0.5, 1) == 50  # order does not matter
    # 0.29 * 100 is 28.999999999999996 in floats: the quantile is taken exactly
    assert resolve_max_length(lengths, 0.29, 1) == 29


@pytest.mark.parametrize("quantile", [0, -0.1, 1.01])
def test_a_quantile_outside_zero_one_is_refused(quantile):
    with pytest.raises(InputError, match="quantile"):
        resolve_max_length([10, 20], quantile)


def test_no_examples_or_a_tiny_cap_are_refused():
    with pytest.raises(InputError, match="no examples"):
        resolve_max_length([], 0.99)
    with pytest.raises(InputError, match=">= 4"):
        resolve_max_length([10], 0.99, cap=3)


def test_lengths_are_the_encoded_examples_and_a_fixed_value_is_left_alone(
        tmp_path, tiny_tokenizer_dir, tiny_pool):
    from clusterft.modeling.hf import load_tokenizer

    tok = load_tokenizer(tiny_tokenizer_dir)
    lengths = example_lengths(tok, tiny_pool)
    assert lengths == [encode_example(tok, r["messages"], 10 ** 6)["length"] for r in tiny_pool]
    cfg = {"max_length": 48, "max_length_quantile": 0.5}
    assert resolve_lengths(cfg, "score", tok, tiny_pool) == (cfg, {})
    assert is_auto("auto") and not is_auto(48) and not is_auto("Auto")
    # auto: the cap key and the model's context bound it
    got, info = resolve_lengths({"max_length": "auto", "max_length_quantile": 1.0,
                                 "max_length_cap": 40}, "train", tok, tiny_pool)
    assert got["max_length"] == 40 and info == {
        "max_length": 40,
        "max_length_source": f"auto q1 of {len(tiny_pool)} examples, capped at 40 "
                             "(train.max_length_cap)"}
    got, info = resolve_lengths({"max_length": "auto"}, "score", tok, tiny_pool)
    assert got["max_length"] == resolve_max_length(lengths, 0.99) == 64
    assert info["max_length_source"] == f"auto q0.99 of {len(tiny_pool)} examples"
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 32}')
    got, info = resolve_lengths({"max_length": "auto"}, "features", tok, tiny_pool, tmp_path)
    assert got["max_length"] == 32 and info["max_length_source"].endswith(
        "capped at 32 (the model's max_position_embeddings)")
