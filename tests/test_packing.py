"""Packed micro-batches (clusterft.modeling.packing): one row per step, position ids
restarting per example, attention inside each example. Per-example losses and every
parameter's gradient equal the padded batch's (fp32; measured on an AMD EPYC, 12 examples:
per-example summed losses to <= 1.5e-7 relative (3e-5 absolute on sums of ~200), gradients
to <= 1e-8 absolute (largest gradient 0.045); asserted at rtol 1e-4 / atol 1e-5), and a
row without the block diagonal is caught."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from clusterft.modeling import packing as pk
from clusterft.modeling.microbatch import CausalLMLoss, backward_step, label_count
from clusterft.modeling.tokenize import IGNORE_INDEX, Collator
from clusterft.pipeline.errors import InputError

RTOL, ATOL = 1e-4, 1e-5


def tiny_llama(kv_heads: int = 4, seed: int = 0):
    """A random-init Llama as clusterft.stages.models.build_model makes them (tied
    embeddings), small enough for seconds."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=256,
        tie_word_embeddings=True, pad_token_id=0))
    model.config.use_cache = False
    model.train()
    return model


def random_examples(n: int, seed: int, vocab: int = 256, lo: int = 4, hi: int = 70) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        k = int(rng.integers(lo, hi))
        p = int(rng.integers(1, k - 1))
        ids = rng.integers(3, vocab, k).tolist()
        out.append({"input_ids": ids, "labels": [IGNORE_INDEX] * p + ids[p:], "length": k})
    return out


def per_example_losses_padded(model, examples) -> torch.Tensor:
    """Summed next-token loss of each example, from one padded batch."""
    batch = Collator(0)(examples)
    with torch.no_grad():
        logits = model(**batch).logits[:, :-1]
    tok = F.cross_entropy(logits.transpose(1, 2), batch["labels"][:, 1:], reduction="none",
                          ignore_index=IGNORE_INDEX)
    return tok.sum(1)


def per_example_losses_packed(model, examples, row=None, impl=pk.PACKED_ATTN) -> torch.Tensor:
    """The same from one packed row (``row``: a packed batch, possibly tampered with)."""
    row = pk.pack_examples(examples) if row is None else row
    with torch.no_grad():
        logits = model(**pk.forward_kwargs(impl, row)).logits[0, :-1]
    tok = F.cross_entropy(logits, row["labels"][0, 1:], reduction="none",
                          ignore_index=IGNORE_INDEX)
    seg = torch.repeat_interleave(torch.arange(len(examples)),
                                  torch.diff(row["cu_seq_lens"]).long())[1:]
    return torch.zeros(len(examples)).index_add(0, seg, tok)


def grads(model) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def test_pack_examples_layout():
    ex = random_examples(5, seed=1)
    row = pk.pack_examples(ex)
    lengths = [e["length"] for e in ex]
    T = sum(lengths)
    assert row["input_ids"].shape == row["labels"].shape == row["position_ids"].shape == (1, T)
    assert row["cu_seq_lens"].tolist() == np.concatenate([[0], np.cumsum(lengths)]).tolist()
    assert row["cu_seq_lens"].dtype == torch.int32
    assert row["position_ids"][0].tolist() == [j for k in lengths for j in range(k)]
    assert row["input_ids"][0].tolist() == [t for e in ex for t in e["input_ids"]]
    starts = row["cu_seq_lens"][:-1].long()
    assert (row["labels"][0, starts] == IGNORE_INDEX).all()  # no cross-example target
    # the targets (labels[1:]) are exactly the padded batch's: same count, same tokens
    assert int((row["labels"][0, 1:] != IGNORE_INDEX).sum()) == sum(label_count(e) for e in ex)
    assert int(row["attention_mask"].sum()) == T


@pytest.mark.parametrize("kv_heads", [4, 2])  # plain and grouped-query attention
@pytest.mark.parametrize("sparse", [True, False])
def test_packed_step_equals_padded_step(kv_heads, sparse):
    """Per-example losses and every parameter's gradient of the packed row equal the padded
    batch's (one padded batch: group_cost_tokens -1)."""
    model = tiny_llama(kv_heads)
    ex = random_examples(12, seed=2)
    ref_losses = per_example_losses_padded(model, ex)
    model.zero_grad(set_to_none=True)
    loss_pad, real_pad, padded = backward_step(CausalLMLoss(model, sparse), ex, Collator(0), -1.0)
    ref = grads(model)

    loss_fn = CausalLMLoss(model, sparse, packing=True)
    assert loss_fn.attn == pk.PACKED_ATTN and model.config._attn_implementation == pk.PACKED_ATTN
    losses = per_example_losses_packed(model, ex)
    torch.testing.assert_close(losses, ref_losses, rtol=RTOL, atol=ATOL)
    model.zero_grad(set_to_none=True)
    loss_pk, real, processed = backward_step(loss_fn, ex, None, 0.0, packed=True)
    assert real == processed == real_pad == sum(e["length"] for e in ex) < padded  # no padding
    assert loss_pk == pytest.approx(loss_pad, rel=RTOL)
    for a, b in zip(grads(model), ref):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    loss_fn.release()
    assert model.config._attn_implementation == "sdpa"


def test_packed_attention_matches_transformers_own_packed_mask():
    """An independent reference: transformers' packed-sequence detection (restarting
    position ids, no mask) builds the block-diagonal causal mask for sdpa itself."""
    model = tiny_llama()
    ex = random_examples(6, seed=3)
    row = pk.pack_examples(ex)
    with torch.no_grad():
        hf = model(input_ids=row["input_ids"], position_ids=row["position_ids"]).logits
    pk.enable(model, "cpu")
    with torch.no_grad():
        ours = model(**pk.forward_kwargs(pk.PACKED_ATTN, row)).logits
    torch.testing.assert_close(ours, hf, rtol=RTOL, atol=ATOL)


def test_wrong_mask_and_unmasked_boundaries_are_caught():
    """The test can fail: without the block diagonal (the whole row one sequence) the
    per-example losses move far outside the tolerance, and so does a row whose boundary
    labels are left in (one more target per example, predicted from the example before)."""
    model = tiny_llama()
    ex = random_examples(8, seed=4)
    ref = per_example_losses_padded(model, ex)
    pk.enable(model, "cpu")
    row = pk.pack_examples(ex)
    torch.testing.assert_close(per_example_losses_packed(model, ex, row), ref, rtol=RTOL, atol=ATOL)
    T = row["input_ids"].shape[1]
    # (1) attention across examples: one causal block over the whole row
    no_diag = dict(row, cu_seq_lens=torch.tensor([0, T], dtype=torch.int32))
    with torch.no_grad():
        logits = model(**pk.forward_kwargs(pk.PACKED_ATTN, no_diag)).logits[0, :-1]
    tok = F.cross_entropy(logits, row["labels"][0, 1:], reduction="none")
    seg = torch.repeat_interleave(torch.arange(len(ex)), torch.diff(row["cu_seq_lens"]).long())[1:]
    wrong = torch.zeros(len(ex)).index_add(0, seg, tok)
    assert wrong[0] == pytest.approx(float(ref[0]), rel=1e-5)  # the first example sees nothing else
    with pytest.raises(AssertionError):
        torch.testing.assert_close(wrong, ref, rtol=RTOL, atol=ATOL)
    assert float((wrong - ref).abs().max()) > 1e3 * ATOL
    # (2) the boundary labels left in, for examples whose first token has a label (a padded
    # row never predicts it; a naive concatenation predicts it from the example before)
    ex = [dict(e, labels=[e["input_ids"][0]] + e["labels"][1:]) for e in ex]
    row = pk.pack_examples(ex)
    torch.testing.assert_close(per_example_losses_packed(model, ex, row), ref, rtol=RTOL, atol=ATOL)
    labels = torch.as_tensor([t for e in ex for t in e["labels"]])[None]
    leaky = dict(row, labels=labels)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(per_example_losses_packed(model, ex, leaky), ref,
                                   rtol=RTOL, atol=ATOL)


def test_padded_batches_still_exact_under_the_packed_attention():
    """A model left on the packed attention runs a padded batch (no plan) as plain sdpa."""
    model = tiny_llama()
    ex = random_examples(6, seed=5)
    batch = Collator(0)(ex)
    with torch.no_grad():
        ref = model(**batch).logits
    pk.enable(model, "cpu")
    with torch.no_grad():
        got = model(**batch).logits
    mask = batch["attention_mask"].bool()
    torch.testing.assert_close(got[mask], ref[mask], rtol=RTOL, atol=ATOL)


def test_packed_with_gradient_checkpointing_has_the_same_gradient():
    from clusterft.stages.train import enable_gradient_checkpointing

    model = tiny_llama()
    ex = random_examples(8, seed=6)
    loss_fn = CausalLMLoss(model, True, packing=True)
    model.zero_grad(set_to_none=True)
    backward_step(loss_fn, ex, None, 0.0, packed=True)
    ref = grads(model)
    enable_gradient_checkpointing(model)
    model.zero_grad(set_to_none=True)
    backward_step(loss_fn, ex, None, 0.0, packed=True)
    for a, b in zip(grads(model), ref):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


def test_attention_blocks_cover_every_token_once():
    ex = random_examples(20, seed=7, lo=3, hi=150)
    row = pk.pack_examples(ex)
    for cost in (-1.0, 0.0, 128.0, 1e9):
        plan = pk.attn_plan(row["cu_seq_lens"], cost)
        T = row["input_ids"].shape[1]
        flat = torch.cat([b.reshape(-1) for b in plan.blocks])
        assert plan.inverse.shape == (T,)
        assert (flat[plan.inverse] == torch.arange(T)).all()  # every token read back once
    assert len(pk.attn_plan(row["cu_seq_lens"], 0.0).blocks) > 1


def test_settings_and_where_packing_applies():
    model = tiny_llama()
    assert pk.check_setting(None) == "auto" and pk.check_setting("false") is False
    for bad in ("yes", 1, 0.5):
        with pytest.raises(InputError, match="train.packing"):
            pk.check_setting(bad)
    assert pk.resolve_packing("auto", model) is True
    assert pk.resolve_packing(True, model) is True
    assert pk.resolve_packing(False, model) is False
    assert pk.attn_implementation("cpu") == pk.PACKED_ATTN
    model.config.model_type, old = "gemma2", model.config.model_type
    try:
        assert pk.resolve_packing("auto", model) is False  # not known exact: padded
        with pytest.raises(InputError, match="not exact"):
            pk.resolve_packing(True, model)
    finally:
        model.config.model_type = old


def test_training_packed_equals_padded_and_is_deterministic(tmp_path, tiny_model_dir, tiny_pool,
                                                          tiny_pool_path):
    """Real optimiser steps (balanced sampler, 2 epochs): packed ends at the padded run's
    weights, records packing: true, and a second packed run with the seed is bit-identical."""
    from clusterft.stages.train import run_train
    from test_train import BASE_CFG, make_selection, weights

    sel = make_selection(tmp_path / "sel.parquet", tiny_pool, 24)
    runs = {}
    for name, packing in (("padded", False), ("packed", "auto"), ("again", True)):
        cfg = {**BASE_CFG, "batch_size": 8, "epochs": 2, "precision": "fp32", "packing": packing}
        m = run_train(tiny_model_dir, tiny_pool_path, sel, tmp_path / name, tmp_path / f"{name}.json",
                      "balanced", 0, cfg)
        runs[name] = (m, weights(tmp_path / name))
    (mp, wp), (mk, wk), (ma, wa) = runs["padded"], runs["packed"], runs["again"]
    assert mp["packing"] is False and mk["packing"] is True and ma["packing"] is True
    assert mk["tokens"] == mp["tokens"] and mk["loss_tokens"] == mp["loss_tokens"]
    assert mk["padded_tokens"] == mk["tokens"] < mp["padded_tokens"]
    np.testing.assert_allclose(mk["loss_curve"], mp["loss_curve"], rtol=1e-4)
    for k in wp:
        torch.testing.assert_close(wk[k], wp[k], rtol=1e-3, atol=1e-5)
    assert mk["loss_curve"] == ma["loss_curve"]
    for k in wk:
        assert torch.equal(wk[k], wa[k]), k
