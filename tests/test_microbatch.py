"""Length-grouped micro-batches and the label-only LM head: optimal plans, exact gradients."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from clusterft.modeling.microbatch import CausalLMLoss, backward_step, padded_size, plan_micro_batches
from clusterft.modeling.tokenize import IGNORE_INDEX, Collator
from clusterft.stages.train import run_train

from test_train import BASE_CFG, make_selection, weights


def brute_force_cost(lengths: list[int], cost: float, multiple: int = 1) -> float:
    """Cheapest split of the sorted lengths into contiguous groups, by enumeration."""
    s = [-(-x // multiple) * multiple for x in sorted(lengths)]
    n, best = len(s), float("inf")
    for mask in itertools.product([0, 1], repeat=n - 1):
        cuts = [0] + [i + 1 for i, m in enumerate(mask) if m] + [n]
        total = sum((b - a) * s[b - 1] + cost for a, b in zip(cuts, cuts[1:]))
        best = min(best, total)
    return best


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("cost", [0.0, 20.0, 300.0])
@pytest.mark.parametrize("multiple", [1, 16])
def test_plan_is_a_partition_and_optimal(seed, cost, multiple):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(5, 200, size=int(rng.integers(1, 10))).tolist()
    groups = plan_micro_batches(lengths, cost, multiple)
    flat = [i for g in groups for i in g]
    assert sorted(flat) == list(range(len(lengths)))  # every example exactly once
    assert all(g for g in groups)
    # groups are runs of the sorted lengths: each group's longest <= the next group's shortest
    for a, b in zip(groups, groups[1:]):
        assert max(lengths[i] for i in a) <= min(lengths[i] for i in b)
    got = padded_size(lengths, groups, multiple) + cost * len(groups)
    assert got == pytest.approx(brute_force_cost(lengths, cost, multiple))
    assert padded_size(lengths, groups, multiple) <= len(lengths) * (-(-max(lengths) // multiple) * multiple)
    assert padded_size(lengths, groups, multiple) % multiple == 0


def test_plan_extremes():
    lengths = [7, 3, 7, 3, 9]
    assert plan_micro_batches(lengths, -1) == [[0, 1, 2, 3, 4]]  # disabled: one batch, as given
    assert len(plan_micro_batches(lengths, 1e9)) == 1  # a group too dear to split
    zero = plan_micro_batches(lengths, 0.0)  # free groups: no padding at all
    assert padded_size(lengths, zero) == sum(lengths)
    assert plan_micro_batches([], 10.0) == []


def test_plan_cuts_padding_of_a_skewed_batch():
    lengths = [20] * 14 + [190, 185]
    groups = plan_micro_batches(lengths, 256)
    assert len(groups) == 2 and padded_size(lengths, groups) == 14 * 20 + 2 * 190
    assert padded_size(lengths, groups) < 0.25 * len(lengths) * max(lengths)


def random_examples(n: int, vocab: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        k = int(rng.integers(6, 40))
        p = int(rng.integers(1, k - 1))
        ids = rng.integers(3, vocab, k).tolist()
        out.append({"input_ids": ids, "labels": [IGNORE_INDEX] * p + ids[p:], "length": k})
    return out


@pytest.fixture(scope="module")
def model_and_batch(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.config.use_cache = False
    model.train()
    torch.manual_seed(0)
    return model, random_examples(12, model.config.vocab_size, seed=3)


@pytest.mark.parametrize("sparse", [True, False])
def test_loss_equals_hf_mean_loss(model_and_batch, sparse):
    model, examples = model_and_batch
    batch = Collator(0)(examples)
    loss_fn = CausalLMLoss(model, sparse_logits=sparse)
    assert loss_fn.sparse is sparse  # tiny model is a Llama: the label-only head applies
    n_label = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    with torch.no_grad():
        hf = model(**batch).loss
        ours = loss_fn(**batch)
    assert float(ours / n_label) == pytest.approx(float(hf), rel=1e-5)


def test_unknown_architecture_uses_full_logits(model_and_batch):
    model, _ = model_and_batch
    model.config.model_type, old = "gemma2", model.config.model_type  # soft-capped logits
    try:
        assert CausalLMLoss(model, sparse_logits=True).sparse is False
    finally:
        model.config.model_type = old


def grads_of(model) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def test_micro_batched_step_has_the_padded_batch_gradient(model_and_batch):
    model, examples = model_and_batch
    collate = Collator(0)
    model.zero_grad(set_to_none=True)
    model(**collate(examples)).loss.backward()
    ref = grads_of(model)
    groups = plan_micro_batches([e["length"] for e in examples], 0.0)
    assert len(groups) > 1
    loss_fn = CausalLMLoss(model, sparse_logits=True)
    model.zero_grad(set_to_none=True)
    loss, real, padded = backward_step(loss_fn, examples, collate, 0.0)  # the train loop's step
    assert real == padded == sum(e["length"] for e in examples)  # cost 0: no padding
    assert loss == pytest.approx(float(model(**collate(examples)).loss), rel=1e-5)
    got = grads_of(model)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_training_matches_the_plain_padded_step(tmp_path, tiny_model_dir, tiny_pool, tiny_pool_path):
    """A few real optimiser steps with and without the rewrites end at the same weights."""
    sel = make_selection(tmp_path / "sel.parquet", tiny_pool, 24)
    outs = {}
    for name, extra in {"plain": {"group_cost_tokens": -1, "sparse_logits": False, "precision": "fp32"},
                        "fast": {"group_cost_tokens": 0, "sparse_logits": True, "precision": "fp32"},
                        "pad16": {"group_cost_tokens": 0, "sparse_logits": True, "precision": "fp32",
                                  "pad_to_multiple_of": 16}}.items():
        # padded micro-batches (packed rows: tests/test_packing.py)
        cfg = {**BASE_CFG, "batch_size": 8, "epochs": 1, "packing": False, **extra}
        m = run_train(tiny_model_dir, tiny_pool_path, sel, tmp_path / name, tmp_path / f"{name}.json",
                      "random", 0, cfg)
        outs[name] = (m, weights(tmp_path / name))
    (mp, wp), (mf, wf) = outs["plain"], outs["fast"]
    assert mf["tokens"] == mp["tokens"] and mf["loss_tokens"] == mp["loss_tokens"]
    assert mf["padded_tokens"] < mp["padded_tokens"]  # less padding processed
    assert mf["padded_tokens"] == mf["tokens"]  # cost 0: no padding at all
    np.testing.assert_allclose(mf["loss_curve"], mp["loss_curve"], rtol=1e-4)
    for k in wp:
        torch.testing.assert_close(wf[k], wp[k], rtol=1e-3, atol=1e-5)
    m16, w16 = outs["pad16"]  # padding to a multiple of 16 changes the shapes, not the result
    assert all(p % 16 == 0 for row in m16["padded_tokens_per_step"] for p in row)
    assert mf["padded_tokens"] < m16["padded_tokens"]
    np.testing.assert_allclose(m16["loss_curve"], mf["loss_curve"], rtol=1e-4)
    for k in wf:
        torch.testing.assert_close(w16[k], wf[k], rtol=1e-3, atol=1e-5)


def test_precision_resolution_and_bf16_training(tmp_path, tiny_model_dir, tiny_pool, tiny_pool_path):
    from clusterft.pipeline.errors import InputError
    from clusterft.modeling.precision import native_bf16, resolve_precision

    assert resolve_precision("auto", "cpu") == "fp32"  # CPUs: bf16 only where chosen
    assert isinstance(native_bf16("cpu"), bool)
    assert resolve_precision("fp32", "cpu") == "fp32" and resolve_precision("bf16", "cpu") == "bf16"
    with pytest.raises(InputError, match="train.precision"):
        resolve_precision("fp8", "cpu", field="train.precision")
    sel = make_selection(tmp_path / "sel.parquet", tiny_pool, 32)
    cfg = {**BASE_CFG, "epochs": 4, "lr": 5e-3, "precision": "bf16"}
    m = run_train(tiny_model_dir, tiny_pool_path, sel, tmp_path / "bf", tmp_path / "bf.json", "random", 0, cfg)
    assert m["precision"] == "bf16"
    assert m["epoch_losses"][-1] < 0.85 * m["epoch_losses"][0], m["epoch_losses"]
    w = weights(tmp_path / "bf")
    assert all(v.dtype == torch.float32 for v in w.values())  # autocast: weights stay float32
