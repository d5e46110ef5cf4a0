"""Tokenizer, model building, pretraining, saving and model resolution on real tiny inputs."""

from __future__ import annotations

import json

import numpy as np

import pytest
import torch

from clusterft.pipeline.errors import InputError
from clusterft.modeling.hf import load_tokenizer, resolve_model
from clusterft.stages.models import (DEFAULTS, build_model, count_params, read_corpus, run_base_model,
                              run_tokenizer, train_tokenizer)

from conftest import stdlib_text


def test_tokenizer_roundtrip_and_special_ids(tiny_tokenizer_dir):
    tok = load_tokenizer(tiny_tokenizer_dir)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<s>", "</s>", "<pad>")
    assert len({tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}) == 3
    assert tok.unk_token is None
    assert len(tok) == 512
    text = "def f(x):\n    return {'a': x ** 2}  # ünïcode ✓\n"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.bos_token_id not in ids[1:]
    assert tok.decode(ids, skip_special_tokens=True) == text
    plain = tok(text, add_special_tokens=False)["input_ids"]
    assert plain == ids[1:]
    assert len(plain) < len(text.encode())  # BPE merged something


def test_tokenizer_training_is_deterministic(tmp_path):
    lines = stdlib_text(("textwrap",), 300)
    a = train_tokenizer(lines, 400, tmp_path / "a", seed=0)
    b = train_tokenizer(lines, 400, tmp_path / "b", seed=0)
    assert a.get_vocab() == b.get_vocab()
    assert (tmp_path / "a" / "tokenizer.json").read_text() == (tmp_path / "b" / "tokenizer.json").read_text()


def test_tokenizer_rejects_tiny_vocab(tmp_path):
    with pytest.raises(InputError, match="vocab_size"):
        train_tokenizer(["abc"], 100, tmp_path / "t")


@pytest.fixture(scope="module")
def default_vocab_tokenizer_dir(tmp_path_factory):
    """A tokenizer with DEFAULTS['vocab_size'] tokens, as the real pipeline builds."""
    tok_dir = tmp_path_factory.mktemp("tok2048") / "tok"
    tok = train_tokenizer(stdlib_text(max_lines=4000), DEFAULTS["vocab_size"], tok_dir)
    assert len(tok) == DEFAULTS["vocab_size"]
    return tok_dir


@pytest.mark.parametrize("size,lo,hi", [("small", 0.5e6, 1.0e6), ("large", 2e6, 5e6)])
def test_param_counts_in_range(default_vocab_tokenizer_dir, size, lo, hi):
    tok_dir = default_vocab_tokenizer_dir
    tok = load_tokenizer(tok_dir)
    model = build_model(tok_dir, DEFAULTS["sizes"][size], seed=0)
    n = count_params(model)
    assert lo <= n <= hi, n
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert (model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id) == (
        tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)


def test_build_model_is_seeded(tiny_tokenizer_dir):
    from conftest import TINY_SIZE

    a = build_model(tiny_tokenizer_dir, TINY_SIZE, seed=3)
    b = build_model(tiny_tokenizer_dir, TINY_SIZE, seed=3)
    c = build_model(tiny_tokenizer_dir, TINY_SIZE, seed=4)
    wa, wb, wc = (m.model.embed_tokens.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


def test_tiny_model_dir_reloads_offline(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True)
    assert model.config.pad_token_id == tok.pad_token_id
    enc = tok(["def f(x):\n", "import os\n"], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model(**enc)
    assert out.logits.shape[:2] == enc["input_ids"].shape
    gen = model.generate(**tok("def ", return_tensors="pt"), max_new_tokens=5, do_sample=False)
    assert gen.shape[1] > 2


def test_run_tokenizer_and_base_model(tmp_path, tiny_corpus_path):
    """The stage functions: tokenizer + pretraining lowers the loss; saved dir reloads."""
    from transformers import AutoModelForCausalLM

    docs = read_corpus(tiny_corpus_path)
    assert len(docs) >= 1
    info = run_tokenizer(tiny_corpus_path, 600, tmp_path / "tok", seed=0)
    assert info["vocab_size"] == 600
    size = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 2, "max_position_embeddings": 128}
    m = run_base_model(tmp_path / "tok", tiny_corpus_path, size,
                       {"steps": 40, "block_size": 64, "batch_size": 8, "warmup_steps": 4,
                        "val_fraction": 0.05}, tmp_path / "base", seed=0)
    assert m["final_loss"] < m["first_loss"] - 0.3
    assert m["val_loss"] is not None and m["val_loss"] < m["first_loss"]
    saved = json.loads((tmp_path / "base" / "pretrain_metrics.json").read_text())
    assert saved["params"] == m["params"]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "base", local_files_only=True)
    assert count_params(model) == m["params"]
    tok = load_tokenizer(tmp_path / "base")
    assert tok.model_max_length == 128
    assert not list(tmp_path.glob(".*.tmp"))  # atomic writes cleaned up


def test_read_corpus_errors(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        read_corpus(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("\n\n\n")
    with pytest.raises(InputError, match="empty"):
        read_corpus(tmp_path / "empty.txt")
    (tmp_path / "bad.txt").write_bytes(b"ok\xff\xfe")
    with pytest.raises(InputError, match="UTF-8"):
        read_corpus(tmp_path / "bad.txt")


def test_resolve_model(tmp_path, tiny_model_dir):
    assert resolve_model(str(tiny_model_dir)) == str(tiny_model_dir)
    with pytest.raises(InputError, match="models.small.path"):
        resolve_model("meta-llama/Llama-2-7b-hf", field="models.small.path")
    assert resolve_model("meta-llama/Llama-2-7b-hf", allow_downloads=True) == "meta-llama/Llama-2-7b-hf"
    (tmp_path / "notamodel").mkdir()
    with pytest.raises(InputError, match="config.json"):
        resolve_model(str(tmp_path / "notamodel"))


def test_run_model_from_config_sections(tmp_path, tiny_corpus_path, tiny_model_dir):
    """The config-section forms: tokenizer {source, vocab_size}; models.<name> build | path | hub."""
    from clusterft.stages.models import run_model

    info = run_tokenizer(tiny_corpus_path, {"source": "build", "vocab_size": 520}, tmp_path / "tok",
                         seed=0)
    assert info["vocab_size"] == 520 and len(load_tokenizer(tmp_path / "tok")) == 520
    size = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    m = run_model(tmp_path / "tok", tiny_corpus_path,
                  {"source": "build", "size": size, "pretrain": {"steps": 3, "block_size": 32,
                                                                "batch_size": 2, "val_fraction": 0}},
                  tmp_path / "built", seed=0, name="tiny", threads=1)
    assert m["steps"] == 3 and (tmp_path / "built" / "model.safetensors").exists()
    run_model(tmp_path / "tok", tiny_corpus_path, {"source": "path", "path": str(tiny_model_dir)},
              tmp_path / "copied", name="local")
    assert (tmp_path / "copied" / "config.json").read_text() == (tiny_model_dir / "config.json").read_text()
    with pytest.raises(InputError, match="models.big.hub_id"):
        run_model(tmp_path / "tok", tiny_corpus_path, {"source": "hub", "hub_id": "org/model"},
                  tmp_path / "hub", name="big")
    with pytest.raises(InputError, match="tokenizer.hub_id"):
        run_tokenizer(tiny_corpus_path, {"source": "hub", "hub_id": "org/model"}, tmp_path / "t2")
    with pytest.raises(InputError, match="unknown model size"):
        run_model(tmp_path / "tok", tiny_corpus_path, {"size": "huge"}, tmp_path / "x", name="x")
    assert not (tmp_path / "hub").exists() and not (tmp_path / "x").exists()


def test_practice_trains_the_built_model_on_the_practice_ciphers(tmp_path, tiny_corpus_path):
    """models.<name>.practice: after pretraining, the model is fine-tuned for exactly
    `steps` steps on the practice ciphers (their loss falls), scored on their held-out items,
    and saved with the practice metrics; without practice the same build gives other weights."""
    from safetensors.numpy import load_file

    from clusterft.stages.models import run_model

    run_tokenizer(tiny_corpus_path, 520, tmp_path / "tok", seed=0)
    size = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 2, "max_position_embeddings": 128}
    pre = {"steps": 3, "block_size": 32, "batch_size": 2, "val_fraction": 0}
    practice = {"steps": 60, "n": 200, "n_words": 8, "words_per_example": 3,
                "global_batch_size": 8, "lr": 1e-2, "attempts": 1}
    m = run_model(tmp_path / "tok", tiny_corpus_path,
                  {"size": size, "pretrain": pre, "practice": practice}, tmp_path / "practised",
                  seed=0, name="tiny", threads=1)
    p = m["practice"]
    assert p["steps"] == 60 and p["examples"] == 200
    assert p["final_loss"] < p["first_loss"] - 0.5
    assert set(p["items_per_cipher"]) == set(p["keys"]) and 0 <= p["items_exact"] <= 1
    saved = json.loads((tmp_path / "practised" / "pretrain_metrics.json").read_text())
    assert saved["practice"]["steps"] == 60
    run_model(tmp_path / "tok", tiny_corpus_path, {"size": size, "pretrain": pre},
              tmp_path / "plain", seed=0, name="tiny", threads=1)
    a = load_file(tmp_path / "practised" / "model.safetensors")
    b = load_file(tmp_path / "plain" / "model.safetensors")
    assert any(not np.array_equal(a[k], b[k]) for k in a)
    assert "practice" not in json.loads((tmp_path / "plain" / "pretrain_metrics.json").read_text())


def test_practice_passes_only_when_every_cipher_is_learnt() -> None:
    """min_exact holds for the worst practice cipher, not the mean: the attempt that left
    the testbed's runs unfitted answered 0.96 on average with one cipher at 0.72."""
    from clusterft.stages.models import practice_passed, practice_rank

    short = {"items_exact": 0.96, "items_per_cipher": {"a": 1.0, "b": 1.0, "c": 0.72}}
    whole = {"items_exact": 0.985, "items_per_cipher": {"a": 1.0, "b": 0.96, "c": 1.0}}
    assert not practice_passed(short, 0.95) and practice_passed(short, 0.7)
    assert practice_passed(whole, 0.95) and not practice_passed(whole, 0.97)
    assert not practice_passed({"items_exact": 0.0, "items_per_cipher": {}}, 0.0)
    higher_mean = {"items_exact": 0.97, "items_per_cipher": {"a": 1.0, "b": 0.5}}
    assert practice_rank(short) > practice_rank(higher_mean)  # the worst cipher first


def test_practice_starts_again_from_the_same_weights_until_the_lookup_is_learnt(
        tmp_path, tiny_corpus_path):
    """practice.attempts / min_exact: an attempt below min_exact is discarded and practice
    runs again from the weights it was given, with the next data-order seed; the first
    attempt is the single run's; with no attempt passing, the best is kept (and warned of);
    an attempt that passes ends it."""
    import copy

    import torch

    from clusterft.modeling.generate import score_items
    from clusterft.modeling.hf import load_tokenizer
    from clusterft.pools import cipher
    from clusterft.stages.models import (PRACTICE_DEFAULTS, build_model, practice,
                                         practice_shape)

    run_tokenizer(tiny_corpus_path, 520, tmp_path / "tok", seed=0)
    tok = load_tokenizer(tmp_path / "tok")
    torch.set_num_threads(1)
    size = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 2, "max_position_embeddings": 128}
    base = build_model(tok, size, seed=0)
    cfg = {**PRACTICE_DEFAULTS, "steps": 60, "n": 200, "n_words": 8, "words_per_example": 3,
           "global_batch_size": 8, "lr": 1e-2}

    single = practice(copy.deepcopy(base), tok, {**cfg, "attempts": 1, "min_exact": 0.0})
    assert [t["order_seed"] for t in single["tries"]] == [0] and single["passed"]

    model = copy.deepcopy(base)
    with pytest.warns(UserWarning, match="none of 3 attempts reached practice.min_exact"):
        p = practice(model, tok, {**cfg, "attempts": 3, "min_exact": 1.0})
    tries = p["tries"]
    assert [t["order_seed"] for t in tries] == [0, 1, 2] and not p["passed"]
    assert tries[0]["final_loss"] == single["final_loss"]  # the first attempt: the single run
    drop = tries[0]["first_loss"] - tries[0]["final_loss"]
    assert drop > 0.5
    for t in tries[1:]:  # each from the given weights, not from the attempt before
        assert t["first_loss"] > tries[0]["final_loss"] + 0.5 * drop
        assert t["final_loss"] != tries[0]["final_loss"]
    best = max(tries, key=lambda t: (min(t["items_per_cipher"].values()), t["items_exact"]))
    assert p["items_exact"] == best["items_exact"] and p["order_seed"] == best["order_seed"]
    items = cipher.build(practice_shape(cfg), seed=0, practice=True).items[cipher.TASK]
    assert round(score_items(model, tok, items, max_new_tokens=12)["exact"], 4) == best["items_exact"]

    # an attempt that passes ends it: a bar every attempt clears stops after the first
    p = practice(copy.deepcopy(base), tok, {**cfg, "attempts": 3, "min_exact": 0.0})
    assert len(p["tries"]) == 1 and p["passed"] and p["final_loss"] == single["final_loss"]
