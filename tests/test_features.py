"""Embedding and TF-IDF features (clusterft.stages.features.representations) on the tiny real Llama and pool
(conftest fixtures): score's format, so cluster runs on them unchanged."""

from __future__ import annotations

import logging

import numpy as np
import pandas as pd
import pytest
import torch

from clusterft.pipeline import provenance
from clusterft.pipeline.errors import InputError
from clusterft.stages.features.representations import (DEFAULTS, KINDS, embedding_features, example_text, merge_cfg,
                                pool_scores, run_features, tfidf_features)
from clusterft.modeling.tokenize import encode_example

EMB = {"batch_size": 8, "max_length": 64, "device": "cpu"}


# The tiny models run several times faster on 1 thread than on 2 shared cores.
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from clusterft.modeling.hf import load_causal_lm, load_tokenizer

    return load_causal_lm(tiny_model_dir), load_tokenizer(tiny_model_dir)


def _rec(rid: str, user: str, answer: str) -> dict:
    return {"id": rid, "messages": [{"role": "user", "content": user},
                                    {"role": "assistant", "content": answer}]}


def _cos(a, b) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_defaults_kinds_documented():
    import inspect

    import clusterft.stages.features.representations as features

    assert set(DEFAULTS) == {"batch_size", "max_length", "max_length_quantile", "max_length_cap",
                             "dim", "device", "precision", "num_threads"}
    assert KINDS == ("embedding", "tfidf")
    src = inspect.getsource(features)
    for key in DEFAULTS:
        assert f'"{key}":' in src
    assert merge_cfg(None) == DEFAULTS and merge_cfg({"dim": 8})["dim"] == 8


@pytest.mark.parametrize("bad, field", [
    ({"dim": 0}, "features.dim"), ({"batch_size": 0}, "features.batch_size"),
    ({"max_length": 2}, "features.max_length"), ({"num_threads": -1}, "features.num_threads"),
    ({"device": "tpu"}, "features.device"), ({"dim": "8"}, "features.dim"),
    ({"dimm": 8}, "features.dimm"),
])
def test_bad_config_names_the_field(bad, field, tiny, tiny_pool, tmp_path, tiny_pool_path):
    with pytest.raises(InputError) as e:
        tfidf_features(tiny_pool[:8], bad)
    assert e.value.field == field and field in str(e.value)
    with pytest.raises(InputError) as e:
        embedding_features(*tiny, tiny_pool[:2], bad)
    assert e.value.field == field
    with pytest.raises(InputError) as e:
        run_features("tfidf", tiny_pool_path, tmp_path / "f.npy", tmp_path / "s.parquet", bad)
    assert e.value.field == field
    assert not (tmp_path / "f.npy").exists()


def test_bad_kind_and_missing_model(tmp_path, tiny_pool_path):
    with pytest.raises(InputError, match="embedding, tfidf") as e:
        run_features("words", tiny_pool_path, tmp_path / "f.npy", tmp_path / "s.parquet")
    assert e.value.field == "kind"
    with pytest.raises(InputError, match="need a model"):
        run_features("embedding", tiny_pool_path, tmp_path / "f.npy", tmp_path / "s.parquet")
    assert not (tmp_path / "f.npy").exists()


def test_pool_scores_is_scores_formula():
    from clusterft.stages.score import pool_scores as score_pool_scores

    f = np.random.default_rng(0).standard_normal((7, 5))
    f = (f / np.linalg.norm(f, axis=1, keepdims=True)).astype(np.float32)
    np.testing.assert_array_equal(pool_scores(f), score_pool_scores(f))
    assert pool_scores(f[:1]).tolist() == [0.0]


# --------------------------------------------------------------------------- embedding

def test_embedding_shape_norms_determinism_model_unchanged(tiny, tiny_pool):
    model, tok = tiny
    model.train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    pool = list(tiny_pool[:20]) + [dict(tiny_pool[3], id="twin-of-3")]
    f = embedding_features(model, tok, pool, EMB)
    assert f.shape == (21, model.config.hidden_size) and f.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(f, axis=1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(f[20], f[3], atol=1e-6)
    assert _cos(f[0], f[1]) < 0.9999  # distinct examples, distinct rows
    np.testing.assert_array_equal(embedding_features(model, tok, pool, EMB), f)
    assert model.training and torch.get_num_threads() == 1
    assert next(model.parameters()).device.type == "cpu"
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) and p.requires_grad, n
    model.eval()


def test_embedding_independent_of_batch_mates_and_order(tiny, tiny_pool):
    model, tok = tiny
    pool = list(tiny_pool[:16])
    lengths = {encode_example(tok, r["messages"], 64)["length"] for r in pool}
    assert len(lengths) > 3  # batches really are padded
    f8 = embedding_features(model, tok, pool, {**EMB, "batch_size": 8})
    f1 = embedding_features(model, tok, pool, {**EMB, "batch_size": 1})
    np.testing.assert_allclose(f8, f1, atol=1e-5)
    fr = embedding_features(model, tok, pool[::-1], {**EMB, "batch_size": 5})
    np.testing.assert_allclose(fr[::-1], f8, atol=1e-5)


def test_embedding_is_mean_of_last_hidden_state(tiny, tiny_pool):
    """Hand computation: the causal LM's hidden_states[-1] (after the final norm), averaged
    over the example's tokens and normalised."""
    model, tok = tiny
    pool = list(tiny_pool[:12])
    f = embedding_features(model, tok, pool, {**EMB, "batch_size": 4})
    model.eval()
    for i in (0, 7):
        ids = torch.tensor([encode_example(tok, pool[i]["messages"], 64)["input_ids"]])
        raw = []
        hook = model.model.layers[-1].register_forward_hook(
            lambda _m, _i, o: raw.append(o[0] if isinstance(o, tuple) else o))
        try:
            with torch.no_grad():
                out = model(input_ids=ids, output_hidden_states=True)
        finally:
            hook.remove()
        h = out.hidden_states[-1][0]
        assert len(out.hidden_states) == model.config.num_hidden_layers + 1
        # hidden_states[-1] is the last decoder layer's output after the final norm
        with torch.no_grad():
            torch.testing.assert_close(h, model.model.norm(raw[0])[0])
        assert not torch.allclose(h, raw[0][0], atol=1e-3)
        ref = h.mean(0).double().numpy()
        np.testing.assert_allclose(f[i], ref / np.linalg.norm(ref), atol=1e-5)


def test_embedding_truncates_and_names_bad_example(tiny, tiny_pool, caplog):
    model, tok = tiny
    long = _rec("long-one", "word " * 200, "answer " * 50)
    with caplog.at_level(logging.WARNING, logger="clusterft.stages.features.representations"):
        f = embedding_features(model, tok, [tiny_pool[0], long], {**EMB, "max_length": 32})
    assert f.shape[0] == 2 and "truncated" in caplog.text
    broken = dict(tiny_pool[1], messages=tiny_pool[1]["messages"][:1])
    with pytest.raises(InputError, match=r"id 'tiny-0001'.*assistant"):
        embedding_features(model, tok, [tiny_pool[0], broken], EMB)


# --------------------------------------------------------------------------- tfidf

def test_tfidf_text_drops_template_markers():
    text = example_text(_rec("a", "Sort the list.", "xs.sort()")["messages"])
    assert "Instruction" not in text and "Response" not in text
    assert "Sort the list." in text and "xs.sort()" in text


def test_tfidf_shape_norms_determinism_and_cap(tiny_pool, caplog):
    f = tfidf_features(tiny_pool, {"dim": 16}, seed=0)
    assert f.shape == (64, 16) and f.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(f, axis=1), 1.0, rtol=1e-6)
    np.testing.assert_array_equal(tfidf_features(tiny_pool, {"dim": 16}, seed=0), f)
    other = tfidf_features(tiny_pool, {"dim": 16}, seed=1)
    assert other.shape == f.shape
    np.testing.assert_allclose(np.linalg.norm(other, axis=1), 1.0, rtol=1e-6)
    with caplog.at_level(logging.WARNING, logger="clusterft.stages.features.representations"):
        capped = tfidf_features(tiny_pool[:10], {"dim": 128}, seed=0)
    assert capped.shape == (10, 10) and "capped to 10" in caplog.text
    assert np.all(np.isfinite(capped))


def test_tfidf_identical_and_related_texts(tiny_pool, tiny_pool_labels):
    pool = list(tiny_pool) + [dict(tiny_pool[5], id="twin-of-5")]
    f = tfidf_features(pool, {"dim": 16}, seed=0)
    np.testing.assert_allclose(f[64], f[5], atol=1e-6)
    # Within a skill (shared instruction words) rows are closer than across skills.
    labels = np.array([tiny_pool_labels[r["id"]] for r in tiny_pool])
    sim = f[:64] @ f[:64].T
    same = labels[:, None] == labels[None, :]
    np.fill_diagonal(same, False)
    across = labels[:, None] != labels[None, :]
    assert sim[same].mean() > sim[across].mean() + 0.3, (sim[same].mean(), sim[across].mean())
    texts = [_rec("py1", "Sort a python list in place", "Call xs.sort() on the list"),
             _rec("py2", "How do I sort a list in python?", "Use sorted(xs) or xs.sort()"),
             _rec("cake", "Bake a chocolate cake", "Mix flour, eggs and cocoa; bake it")]
    g = tfidf_features(texts, {"dim": 8}, seed=0)
    assert g.shape == (3, 3)
    assert g[0] @ g[1] > g[0] @ g[2] + 0.2 and g[0] @ g[1] > g[1] @ g[2] + 0.2


def test_tfidf_zero_rows_name_the_example(tiny_pool):
    empty = _rec("blank-7", "   ", "\n")
    with pytest.raises(InputError, match=r"blank-7.*empty|empty.*blank-7") as e:
        tfidf_features([*tiny_pool[:6], empty], {"dim": 4}, seed=0)
    assert "nan" not in str(e.value).lower()
    with pytest.raises(InputError, match="blank-7"):
        tfidf_features([empty, dict(empty, id="blank-8")], {"dim": 4}, seed=0)
    # A text sharing no term with the rest falls outside the one kept component.
    docs = [_rec("a1", "red fox", "jumps"), _rec("a2", "red fox", "jumps"),
            _rec("odd-one", "zebra", "quartz")]
    with pytest.raises(InputError, match=r"odd-one.*features\.dim"):
        tfidf_features(docs, {"dim": 1}, seed=0)
    assert tfidf_features(docs, {"dim": 2}, seed=0).shape == (3, 2)


# --------------------------------------------------------------------------- stage edge

@pytest.fixture(scope="module")
def written(tmp_path_factory, tiny_model_dir, tiny_pool_path):
    """Both kinds written by run_features from the tiny pool."""
    out = {}
    for kind in KINDS:
        d = tmp_path_factory.mktemp(kind)
        info = run_features(kind, tiny_pool_path, d / "features.npy", d / "scores.parquet",
                            {**EMB, "dim": 16}, seed=0,
                            model_dir=tiny_model_dir if kind == "embedding" else None)
        out[kind] = (d, info)
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_run_features_then_cluster(kind, written, tiny_pool, tiny_pool_labels, tiny_model_dir):
    from clusterft.stages.cluster import run_cluster
    from clusterft.analysis.stats import cluster_agreement

    d, info = written[kind]
    f = np.load(d / "features.npy")
    df = pd.read_parquet(d / "scores.parquet")
    dim = 32 if kind == "embedding" else 16  # hidden size / features.dim
    assert f.shape == (64, dim) and f.dtype == np.float32
    assert info["kind"] == kind and info["n"] == 64 and info["dim"] == dim and info["seconds"] >= 0
    np.testing.assert_allclose(np.linalg.norm(f, axis=1), 1.0, rtol=1e-6)
    assert list(df.columns) == ["id", "score", "grad_norm"]
    assert df["id"].tolist() == [r["id"] for r in tiny_pool]
    np.testing.assert_allclose(df["score"], pool_scores(f), rtol=1e-6)
    assert df["grad_norm"].isna().all()
    prov = provenance.read(d / "features.npy")
    assert prov["stage"] == f"features-{kind}" and prov["config"]["kind"] == kind
    assert prov["lineage"]["score_run"] == provenance.read(d / "scores.parquet")["lineage"]["score_run"]
    assert "pool" in prov["lineage"]
    assert ("tokenizer" in prov["lineage"]) == (kind == "embedding")
    summary = run_cluster(d / "features.npy", d / "scores.parquet", {"k": 4, "n_init": 3},
                          d / "clusters.parquet", d / "centroids.npy", seed=0)
    assert summary["k"] == 4 and sum(summary["sizes"]) == 64
    cl = pd.read_parquet(d / "clusters.parquet")
    assert cl["id"].tolist() == df["id"].tolist()
    if kind == "tfidf":  # the four skills differ in their instruction words
        agree = cluster_agreement(cl["cluster"], [tiny_pool_labels[i] for i in cl["id"]])
        assert agree["purity"] == 1.0, agree


def test_cluster_refuses_features_and_scores_of_two_runs(written, tmp_path):
    from clusterft.stages.cluster import run_cluster

    emb, tfidf = written["embedding"][0], written["tfidf"][0]
    with pytest.raises(InputError, match="score runs"):
        run_cluster(tfidf / "features.npy", emb / "scores.parquet", {"k": 4, "n_init": 1},
                    tmp_path / "c.parquet", tmp_path / "c.npy")
