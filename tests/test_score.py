"""Per-example gradient features on the tiny real Llama (conftest fixtures)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from clusterft.pipeline.errors import InputError
from clusterft.modeling.lora import DEFAULTS as LORA
from clusterft.modeling.lora import add_lora
from clusterft.stages.score import (ADAM_BETAS, ADAM_EPS, DEFAULTS, Projector, adam_direction,
                             compute_features, compute_features_info, l2_normalize,
                             lora_parameters, merge_cfg, per_example_grads, per_example_loss,
                             pool_scores, run_score, warmup_lora)
from clusterft.modeling.tokenize import collate, encode_example

FAST = {"dim": 64, "batch_size": 8, "max_length": 64, "warmup_steps": 4, "warmup_lr": 5e-3,
        "warmup_fraction": 0.25, "lora": {"r": 4, "alpha": 8}}
LORA_FAST = {**DEFAULTS["lora"], **FAST["lora"]}


# The tiny models run several times faster on 1 thread than on 2 shared cores.
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from clusterft.modeling.hf import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    return model, tok


def _encode(tok, records, max_length=64):
    return [encode_example(tok, r["messages"], max_length) for r in records]


def _fresh(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)


def _hand_features(tiny_model_dir, tok, pool, cfg, seed=0, method="hook", checkpoint=-1):
    """The gradient features written out step by step (the algorithm before warm-up
    checkpoints): warm up, take ``checkpoint``'s adapters (and moments), per-example
    gradients (``method``; the score run's length-sorted batches), optional Adam direction,
    projection, normalisation. Returns (rows [N, dim], grad norms [N], warm-up info)."""
    cfg = merge_cfg(cfg)
    pm = add_lora(_fresh(tiny_model_dir), cfg["lora"], "score.lora", seed)
    enc = _encode(tok, pool, cfg["max_length"])
    info = warmup_lora(pm, enc, cfg, seed, pad_id=tok.pad_token_id)
    ck = info["checkpoints"][checkpoint]
    with torch.no_grad():
        for name, p in lora_parameters(pm):
            p.copy_(ck["lora"][name])
    pm.eval()
    proj = Projector(sum(p.numel() for _, p in lora_parameters(pm)), cfg["dim"], seed,
                     cfg["projection"])
    order = np.argsort([e["length"] for e in enc], kind="stable")
    bs = cfg["batch_size"]
    rows = np.zeros((len(pool), cfg["dim"]), dtype=np.float32)
    norms = np.zeros(len(pool), dtype=np.float32)
    for lo in range(0, len(pool), bs):
        idx = order[lo:lo + bs]
        g = per_example_grads(pm, collate([enc[i] for i in idx], tok.pad_token_id), method)
        if cfg["gradient_type"] == "adam":
            g = adam_direction(g, ck["exp_avg"], ck["exp_avg_sq"])
        norms[idx] = g.norm(dim=1).numpy()
        rows[idx] = proj(g).numpy()
    pm.unload()
    return l2_normalize(rows), norms, info


def _hf_losses(model, tok, pool, max_length=64):
    """Each example's loss as the HF model computes it, one example alone."""
    out = []
    with torch.no_grad():
        for e in _encode(tok, pool, max_length):
            out.append(float(model(**collate([e], tok.pad_token_id)).loss))
    return np.array(out)


def test_defaults_documented():
    import inspect

    import clusterft.stages.score as score

    src = inspect.getsource(score)
    for key in DEFAULTS:
        assert f'"{key}":' in src
    assert DEFAULTS["method"] == "hook"


def test_hook_and_func_match_loop(tiny_model_dir, tiny, tiny_pool):
    _, tok = tiny
    model = _fresh(tiny_model_dir)
    pm = add_lora(model, {**LORA, "r": 4, "alpha": 8, "dropout": 0.0}, "score.lora", seed=0)
    enc = _encode(tok, tiny_pool)
    warmup_lora(pm, enc, FAST, seed=0, pad_id=tok.pad_token_id)  # lora_B != 0: A-grads live
    pm.eval()
    # Uneven lengths, so the batch really is padded.
    picks = [0, 1, 2, 3, 17, 30]
    batch = collate([enc[i] for i in picks], tok.pad_token_id)
    assert (batch["attention_mask"] == 0).any()
    ref = per_example_grads(pm, batch, "loop")
    d = sum(p.numel() for _, p in lora_parameters(pm))
    assert ref.shape == (len(picks), d)
    assert (ref.norm(dim=1) > 0).all()
    for method in ("hook", "func"):
        g = per_example_grads(pm, batch, method)
        assert g.shape == ref.shape
        cos = torch.nn.functional.cosine_similarity(g, ref, dim=1)
        assert (cos > 0.999).all(), (method, cos)
        torch.testing.assert_close(g.norm(dim=1), ref.norm(dim=1), rtol=1e-3, atol=1e-6)
    # Per-example, not batch-mean: rows differ from each other.
    assert torch.nn.functional.cosine_similarity(ref[0], ref[1], dim=0) < 0.999
    pm.unload()


def test_per_example_loss_equals_hf_loss_of_the_example_alone(tiny, tiny_pool):
    model, tok = tiny
    model.eval()
    enc = _encode(tok, tiny_pool)
    picks = [0, 1, 2, 3, 17, 30]
    batch = collate([enc[i] for i in picks], tok.pad_token_id)
    assert (batch["attention_mask"] == 0).any()  # padded: the batch mates differ in length
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        per = per_example_loss(logits, batch["labels"])
        for b, i in enumerate(picks):
            alone = model(**collate([enc[i]], tok.pad_token_id)).loss
            torch.testing.assert_close(per[b], alone, rtol=1e-5, atol=0)
    assert len(set(per.tolist())) > 1


def test_loss_normalization_sum_is_mean_times_answer_tokens(tiny_model_dir, tiny, tiny_pool):
    """score.loss_normalization sum: each example's gradient is its mean-loss gradient times
    its answer-token count (every method, sparse logits too); the default is mean, unchanged."""
    _, tok = tiny
    assert DEFAULTS["loss_normalization"] == "mean"  # docs/method_choices.md
    pm = add_lora(_fresh(tiny_model_dir), {**LORA_FAST, "dropout": 0.0}, "score.lora", seed=0)
    enc = _encode(tok, tiny_pool)
    warmup_lora(pm, enc, FAST, seed=0, pad_id=tok.pad_token_id)
    pm.eval()
    batch = collate([enc[i] for i in (0, 1, 2, 3, 17, 30)], tok.pad_token_id)
    count = (batch["labels"][:, 1:] != -100).sum(1).float()
    assert len(set(count.tolist())) > 1  # answers of different lengths
    for method, sparse in (("hook", False), ("hook", True), ("func", False), ("loop", False)):
        mean = per_example_grads(pm, batch, method, sparse)
        torch.testing.assert_close(per_example_grads(pm, batch, method, sparse,
                                                     normalization="mean"), mean)
        total = per_example_grads(pm, batch, method, sparse, normalization="sum")
        torch.testing.assert_close(total, mean * count[:, None], rtol=1e-4, atol=1e-6)
    with pytest.raises(InputError, match="score.loss_normalization"):
        merge_cfg({"loss_normalization": "token"})
    pm.unload()


def test_adam_direction_is_less_formula_on_adamw_moments():
    assert ADAM_BETAS == (0.9, 0.999) and ADAM_EPS == 1e-8  # LESS's (and AdamW's) defaults
    b1, b2 = ADAM_BETAS
    gen = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(6, generator=gen))
    target, scale = torch.randn(6, generator=gen), torch.rand(6, generator=gen) * 3
    opt = torch.optim.AdamW([w], lr=1e-2, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=0.0)
    m_hand, v_hand = [0.0] * 6, [0.0] * 6
    for _ in range(3):
        opt.zero_grad()
        (scale * (w - target) ** 2).sum().backward()
        g = w.grad.tolist()
        m_hand = [b1 * m + (1 - b1) * x for m, x in zip(m_hand, g)]
        v_hand = [b2 * v + (1 - b2) * x * x for v, x in zip(v_hand, g)]
        opt.step()
    m, v = opt.state[w]["exp_avg"], opt.state[w]["exp_avg_sq"]
    np.testing.assert_allclose(m.numpy(), m_hand, rtol=1e-5)
    np.testing.assert_allclose(v.numpy(), v_hand, rtol=1e-5)
    grads = torch.randn(4, 6, generator=gen)
    got = adam_direction(grads, m, v)
    mm, vv = m.tolist(), v.tolist()
    want = [[(b1 * mm[j] + (1 - b1) * x) / math.sqrt(b2 * vv[j] + (1 - b2) * x * x + ADAM_EPS)
             for j, x in enumerate(row)] for row in grads.tolist()]
    np.testing.assert_allclose(got.numpy(), np.array(want), rtol=1e-5)


@pytest.mark.parametrize("gradient_type", ["sgd", "adam"])
def test_features_match_hand_pipeline_and_one_example_loop(tiny_model_dir, tiny, tiny_pool,
                                                           gradient_type):
    _, tok = tiny
    pool = list(tiny_pool[:16])
    cfg = {**FAST, "gradient_type": gradient_type}
    f, s, n, info = compute_features_info(_fresh(tiny_model_dir), tok, pool, cfg, seed=0)
    # The same batches step by step: bit for bit (the single-checkpoint features as they were).
    hf, hn, _ = _hand_features(tiny_model_dir, tok, pool, cfg, method="hook")
    np.testing.assert_array_equal(f, hf)
    np.testing.assert_array_equal(n, hn)
    np.testing.assert_array_equal(s, pool_scores(hf))
    # One unpadded example at a time.
    lf, ln, _ = _hand_features(tiny_model_dir, tok, pool, cfg, method="loop")
    cos = np.sum(f * lf, axis=1)
    assert np.all(cos >= 0.999), cos
    np.testing.assert_allclose(n, ln, rtol=1e-3)
    assert info["dim"] == 64 and info["checkpoint_steps"] == [4]
    assert info["checkpoint_weights"] == [1.0]


def test_warmup_changes_only_lora_weights(tiny_model_dir, tiny, tiny_pool):
    _, tok = tiny
    model = _fresh(tiny_model_dir)
    base_before = {n: p.detach().clone() for n, p in model.named_parameters()}
    pm = add_lora(model, LORA_FAST, "score.lora", seed=0)
    before = {n: p.detach().clone() for n, p in lora_parameters(pm)}
    assert all(float(v.abs().sum()) == 0 for n, v in before.items() if "lora_B" in n)
    info = warmup_lora(pm, _encode(tok, tiny_pool), FAST, seed=0, pad_id=tok.pad_token_id)
    assert info["warmup_steps"] == 4 and len(info["warmup_losses"]) == 4
    assert info["warmup_examples"] == 16  # 25% of 64
    after = dict(lora_parameters(pm))
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert len(changed) == len(before)
    assert all(float(after[n].detach().abs().sum()) > 0 for n in before if "lora_B" in n)
    base = pm.unload()
    for n, p in base.named_parameters():
        assert torch.equal(p, base_before[n]), n


def test_warmup_epochs_sets_steps(tiny_model_dir, tiny, tiny_pool):
    _, tok = tiny
    pm = add_lora(_fresh(tiny_model_dir), LORA_FAST, "score.lora", seed=0)
    cfg = {**FAST, "warmup_steps": None, "warmup_epochs": 2}  # 16 examples / 8 per batch
    info = warmup_lora(pm, _encode(tok, tiny_pool), cfg, seed=0, pad_id=tok.pad_token_id)
    assert info["warmup_steps"] == 4


def test_projection_deterministic_chunked_and_scaled():
    d, dim = 5000, 32  # two row chunks
    p1, p2 = Projector(d, dim, seed=3), Projector(d, dim, seed=3, cache_bytes=0)
    m1 = p1.matrix()
    assert m1.shape == (d, dim) and m1.dtype == torch.float32
    assert torch.equal(m1, p2.matrix())
    assert not torch.equal(m1, Projector(d, dim, seed=4).matrix())
    assert torch.allclose(m1.abs(), torch.full_like(m1, dim ** -0.5))
    assert 0.45 < float((m1 > 0).float().mean()) < 0.55
    g = torch.randn(6, d, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(p1(g), p2(g))
    torch.testing.assert_close(p1(g), g @ m1, rtol=1e-4, atol=1e-4)
    gauss = Projector(d, 256, seed=3, kind="gaussian")
    ratio = gauss(g).norm(dim=1) / g.norm(dim=1)  # JL: norms roughly preserved
    assert ((ratio > 0.75) & (ratio < 1.25)).all(), ratio
    with pytest.raises(InputError, match="rademacher"):
        Projector(d, dim, seed=0, kind="sparse")


def test_normalize_and_pool_scores():
    x = np.array([[3.0, 4.0], [1.0, 0.0], [1.0, 0.0]], dtype=np.float32)
    f = l2_normalize(x)
    np.testing.assert_allclose(np.linalg.norm(f, axis=1), 1.0, rtol=1e-6)
    s = pool_scores(f)
    # mean cosine with the OTHER rows
    np.testing.assert_allclose(s, [(0.6 + 0.6) / 2, (0.6 + 1.0) / 2, (0.6 + 1.0) / 2], rtol=1e-6)
    with pytest.raises(ValueError, match="zero gradient"):
        l2_normalize(np.zeros((2, 3), dtype=np.float32))


def test_features_shape_twin_and_determinism(tiny_model_dir, tiny, tiny_pool):
    _, tok = tiny
    pool = list(tiny_pool[:24]) + [dict(tiny_pool[3], id="twin-of-3")]
    feats, scores, norms = compute_features(_fresh(tiny_model_dir), tok, pool, FAST, seed=0)
    assert feats.shape == (25, 64) and feats.dtype == np.float32
    assert scores.shape == norms.shape == (25,)
    np.testing.assert_allclose(np.linalg.norm(feats, axis=1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(feats[24], feats[3], atol=1e-5)
    assert scores[24] == pytest.approx(scores[3], abs=1e-5)
    assert norms[24] == pytest.approx(norms[3], rel=1e-4)
    assert np.all(norms > 0)
    # Distinct examples get distinct features.
    assert float(feats[0] @ feats[1]) < 0.999
    again, s2, n2 = compute_features(_fresh(tiny_model_dir), tok, pool, FAST, seed=0)
    np.testing.assert_array_equal(feats, again)
    np.testing.assert_array_equal(scores, s2)
    other, _, _ = compute_features(_fresh(tiny_model_dir), tok, pool, FAST, seed=1)
    assert not np.allclose(feats, other, atol=1e-3)


def test_rows_follow_input_order(tiny_model_dir, tiny, tiny_pool):
    _, tok = tiny
    cfg = {**FAST, "warmup_steps": 0}  # warm-up subset depends on order; gradients must not
    pool = list(tiny_pool[:20])
    f, s, n = compute_features(_fresh(tiny_model_dir), tok, pool, cfg, seed=0)
    fr, sr, nr = compute_features(_fresh(tiny_model_dir), tok, pool[::-1], cfg, seed=0)
    np.testing.assert_allclose(fr[::-1], f, atol=1e-5)
    np.testing.assert_allclose(nr[::-1], n, rtol=1e-4)
    np.testing.assert_allclose(sr[::-1], s, atol=1e-5)


def test_func_method_and_adam_end_to_end(tiny_model_dir, tiny, tiny_pool):
    _, tok = tiny
    pool = list(tiny_pool[:16])
    fh, _, nh = compute_features(_fresh(tiny_model_dir), tok, pool, FAST, seed=0)
    ff, _, nf = compute_features(_fresh(tiny_model_dir), tok, pool, {**FAST, "method": "func"}, seed=0)
    assert np.all(np.sum(fh * ff, axis=1) > 0.999)
    fs, _, _ = compute_features(_fresh(tiny_model_dir), tok, pool,
                                {**FAST, "attn_implementation": "sdpa"}, seed=0)
    assert np.all(np.sum(fh * fs, axis=1) > 0.999)  # the kernel changes speed, not features
    fa, _, _ = compute_features(_fresh(tiny_model_dir), tok, pool,
                                {**FAST, "gradient_type": "adam"}, seed=0)
    np.testing.assert_allclose(np.linalg.norm(fa, axis=1), 1.0, rtol=1e-5)
    assert not np.allclose(fa, fh, atol=1e-2)
    with pytest.raises(InputError, match="warm-up"):
        compute_features(_fresh(tiny_model_dir), tok, pool,
                         {**FAST, "gradient_type": "adam", "warmup_steps": 0}, seed=0)


def test_model_left_unchanged(tiny_model_dir, tiny, tiny_pool):
    _, tok = tiny
    model = _fresh(tiny_model_dir)
    attn = model.config._attn_implementation
    threads = torch.get_num_threads()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _, _, _, info = compute_features_info(model, tok, tiny_pool[:12],
                                          {**FAST, "attn_implementation": "eager"}, seed=0)
    assert attn != "eager" and model.config._attn_implementation == attn
    assert all(p.requires_grad for p in model.parameters())
    assert torch.get_num_threads() == threads
    assert not any("lora" in n for n, _ in model.named_modules())
    assert set(dict(model.named_parameters())) == set(before)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n])
    assert info["n"] == 12 and info["truncated"] == 0 and len(info["warmup_losses"]) == 4


def test_config_errors(tiny_model_dir, tiny, tiny_pool):
    _, tok = tiny
    for bad, match in (({"dimm": 3}, "unknown key"), ({"method": "jvp"}, "hook, func"),
                       ({"warmup_fraction": 0}, "warmup_fraction"),
                       ({"lora": {"target_modules": ["nope_proj"]}}, "nope_proj")):
        model = _fresh(tiny_model_dir)
        with pytest.raises(InputError, match=match):
            compute_features(model, tok, tiny_pool[:4], {**FAST, **bad}, seed=0)
        assert all(p.requires_grad for p in model.parameters())  # left as it was
    with pytest.raises(InputError, match=r"example 1 \(id 'tiny-0001'\).*assistant"):
        broken = [tiny_pool[0], dict(tiny_pool[1], messages=tiny_pool[1]["messages"][:1])]
        compute_features(_fresh(tiny_model_dir), tok, broken, FAST, seed=0)


def test_run_score_writes_outputs(tmp_path, tiny_model_dir, tiny_pool_path, tiny_pool):
    feats_p, scores_p = tmp_path / "f" / "features.npy", tmp_path / "f" / "scores.parquet"
    info = run_score(tiny_model_dir, tiny_pool_path, FAST, feats_p, scores_p, seed=0, threads=1)
    f = np.load(feats_p)
    df = pd.read_parquet(scores_p)
    assert f.shape == (len(tiny_pool), 64) and f.dtype == np.float32
    assert list(df.columns) == ["id", "score", "grad_norm"]
    assert df["id"].tolist() == [r["id"] for r in tiny_pool]
    assert np.all(df["grad_norm"] > 0) and np.all(np.abs(df["score"]) <= 1)
    assert info["n"] == len(tiny_pool)


def test_run_score_rejects_bad_pool(tmp_path, tiny_model_dir):
    p = tmp_path / "pool.jsonl"
    p.write_text('{"id": "a", "messages": [{"role": "user", "content": "hi"}, '
                 '{"role": "assistant", "content": "yo"}]}\n'
                 '{"id": "a", "messages": [{"role": "user", "content": "hi"}, '
                 '{"role": "assistant", "content": "yo"}]}\n', encoding="utf-8")
    with pytest.raises(InputError, match=r"line 2.*duplicate id"):
        run_score(tiny_model_dir, p, FAST, tmp_path / "f.npy", tmp_path / "s.parquet")
    assert not (tmp_path / "f.npy").exists()


def test_sparse_logits_give_the_full_logits_losses_and_gradients(tiny_model_dir, tiny, tiny_pool):
    """The label-only LM head (score.sparse_logits) computes the same per-example losses,
    batch loss and per-example gradients as the full logits, and the same features and
    trajectories end to end, up to float rounding."""
    from clusterft.stages.score import batch_loss, example_losses, use_sparse_logits

    _, tok = tiny
    pm = add_lora(_fresh(tiny_model_dir), {**LORA, "r": 4, "alpha": 8, "dropout": 0.0},
                  "score.lora", seed=0)
    enc = _encode(tok, tiny_pool)
    warmup_lora(pm, enc, {**FAST, "sparse_logits": False}, seed=0, pad_id=tok.pad_token_id)
    pm.eval()
    assert use_sparse_logits(pm, merge_cfg(FAST))
    assert not use_sparse_logits(pm, merge_cfg({**FAST, "sparse_logits": False}))
    batch = collate([enc[i] for i in (0, 1, 2, 3, 17, 30)], tok.pad_token_id)
    assert (batch["attention_mask"] == 0).any() and (batch["labels"] == -100).any()
    with torch.no_grad():
        torch.testing.assert_close(example_losses(pm, batch, True),
                                   example_losses(pm, batch, False), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(batch_loss(pm, batch, True), pm(**batch).loss,
                                   rtol=1e-6, atol=1e-6)
    g_sparse = per_example_grads(pm, batch, "hook", sparse=True)
    g_full = per_example_grads(pm, batch, "hook", sparse=False)
    assert (g_full.norm(dim=1) > 0).all()
    torch.testing.assert_close(g_sparse, g_full, rtol=1e-5, atol=1e-7)
    pm.unload()
    out = {}
    for sparse in (True, False):
        f, _, norms, info = compute_features_info(_fresh(tiny_model_dir), tok, tiny_pool,
                                                  {**FAST, "sparse_logits": sparse}, seed=0)
        out[sparse] = (f, norms, info)
    np.testing.assert_allclose(out[True][0], out[False][0], atol=1e-5)
    np.testing.assert_allclose(out[True][1], out[False][1], rtol=1e-5)
    np.testing.assert_allclose(out[True][2]["loss_trajectories"],
                               out[False][2]["loss_trajectories"], rtol=1e-5)
    np.testing.assert_allclose(out[True][2]["warmup_losses"], out[False][2]["warmup_losses"],
                               rtol=1e-4)


def test_sparse_logits_only_where_the_architecture_allows_and_checked():
    from transformers import GPT2Config, GPT2LMHeadModel

    from clusterft.stages.score import use_sparse_logits

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64,
                                      n_positions=32))
    assert not use_sparse_logits(gpt2, merge_cfg({}))  # not in SPARSE_LOGIT_TYPES: full logits
    with pytest.raises(InputError, match="true or false") as err:
        merge_cfg({"sparse_logits": "yes"})
    assert err.value.field == "score.sparse_logits"


def _spread_pool(n: int = 24) -> list[dict]:
    """Examples whose responses grow from 0 to 2(n-1) words: tiny-tokenizer lengths 34-216."""
    words = ("alpha", "beta", "gamma", "delta")
    return [{"id": f"spread-{i:02d}", "source": "test/spread",
             "messages": [{"role": "user", "content": f"Say {i} words."},
                          {"role": "assistant",
                           "content": " ".join(words[j % 4] for j in range(2 * i)) or "none"}]}
            for i in range(n)]


def test_max_length_auto_is_measured_on_the_pool_and_recorded(tmp_path, tiny_model_dir, tiny):
    """score.max_length: auto is the quantile of the pool's token lengths (rounded up to 64,
    at most the model's context), the run cuts at it, and its provenance records it; train's
    auto length policy is checked at the value train will resolve."""
    from clusterft.modeling.lengths import example_lengths, resolve_max_length
    from clusterft.pipeline import provenance
    from clusterft.pipeline.io import write_jsonl

    _, tok = tiny
    pool = _spread_pool()
    path = tmp_path / "pool.jsonl"
    write_jsonl(path, pool)
    lengths = example_lengths(tok, pool)
    want = resolve_max_length(lengths, 0.75, 64, 256)
    assert want == 192 < max(lengths)  # the 18th of 24 lengths, 160, rounded up; 3 are cut
    feats = tmp_path / "f" / "features.npy"
    cfg = {**FAST, "max_length": "auto", "max_length_quantile": 0.75}
    info = run_score(tiny_model_dir, path, cfg, feats, tmp_path / "f" / "scores.parquet",
                     seed=0, threads=1)
    source = f"auto q0.75 of {len(pool)} examples"
    assert info["max_length"] == want and info["max_length_source"] == source
    assert info["truncated"] == sum(n > want for n in lengths) > 0
    recorded = provenance.read(feats)["config"]
    assert recorded["max_length"] == want and recorded["max_length_source"] == source
    # the features equal a run with the resolved value written out (only the record differs)
    fixed = tmp_path / "g" / "features.npy"
    run_score(tiny_model_dir, path, {**cfg, "max_length": want}, fixed,
              tmp_path / "g" / "scores.parquet", seed=0, threads=1)
    assert np.array_equal(np.load(feats), np.load(fixed))
    # train's max_length auto under truncation 'error': refused before any model work
    with pytest.raises(InputError, match=r"longer than max_length = 128 \(truncation"):
        run_score(tiny_model_dir, path, FAST, tmp_path / "h.npy", tmp_path / "h.parquet",
                  length_policy={"max_length": "auto", "max_length_quantile": 0.25,
                                 "truncation": "error"})
