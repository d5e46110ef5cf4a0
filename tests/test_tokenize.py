"""encode_example: prompt masking, EOS, truncation policies; collate: dynamic padding."""

from __future__ import annotations

import pytest
import torch

from clusterft.pipeline.errors import InputError
from clusterft.modeling.hf import load_tokenizer
from clusterft.modeling.prompt import render_example
from clusterft.modeling.tokenize import IGNORE_INDEX, Collator, encode_example, encode_records


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_dir):
    return load_tokenizer(tiny_tokenizer_dir)


def msgs(q: str, a: str, system: str | None = None) -> list[dict]:
    m = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return ([{"role": "system", "content": system}] if system else []) + m


def test_loss_only_on_response_and_eos(tok):
    m = msgs("Reverse the word: apple", "elppa")
    enc = encode_example(tok, m, 256)
    prompt, response = render_example(m)
    ids, labels = enc["input_ids"], enc["labels"]
    assert enc["length"] == len(ids) == len(labels) and not enc["truncated"]
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    n_prompt = sum(1 for x in labels if x == IGNORE_INDEX)
    # masked part decodes to exactly the prompt, supervised part to response + eos
    assert tok.decode(ids[:n_prompt], skip_special_tokens=True) == prompt
    assert labels[:n_prompt] == [IGNORE_INDEX] * n_prompt
    assert labels[n_prompt:] == ids[n_prompt:]
    assert tok.decode(labels[n_prompt:-1]) == response
    assert labels[-1] == tok.eos_token_id
    # the whole sequence decodes to the rendered text
    assert tok.decode(ids, skip_special_tokens=True) == prompt + response


def test_system_message_is_prompt(tok):
    enc = encode_example(tok, msgs("q", "a", system="Be brief."), 256)
    n_prompt = enc["labels"].count(IGNORE_INDEX)
    assert "Be brief." in tok.decode(enc["input_ids"][:n_prompt])


def test_truncate_cuts_response_keeps_prompt(tok):
    m = msgs("Say it", "word " * 200)
    full = encode_example(tok, m, 10_000)
    n_prompt = full["labels"].count(IGNORE_INDEX)
    enc = encode_example(tok, m, n_prompt + 5, "truncate")
    assert enc["truncated"] and enc["length"] == n_prompt + 5
    assert enc["input_ids"] == full["input_ids"][: n_prompt + 5]
    assert enc["labels"][n_prompt:] == full["input_ids"][n_prompt:n_prompt + 5]
    assert enc["input_ids"][-1] != tok.eos_token_id  # cut before EOS


def test_truncate_long_prompt_keeps_its_end(tok):
    m = msgs("lorem ipsum " * 200, "short answer")
    full = encode_example(tok, m, 10_000)
    enc = encode_example(tok, m, 32, "truncate")
    assert enc["truncated"] and enc["length"] == 32
    assert enc["input_ids"][0] == tok.bos_token_id
    r = [x for x in full["labels"] if x != IGNORE_INDEX]
    n_r = len(r) if len(r) <= 16 else 16
    assert enc["labels"][-n_r:] == r[:n_r]  # response (with its start) supervised
    assert enc["labels"].count(IGNORE_INDEX) == 32 - n_r
    n_prompt_full = full["labels"].count(IGNORE_INDEX)
    # prompt keeps its end ("### Response:\n")
    assert enc["input_ids"][1:32 - n_r] == full["input_ids"][n_prompt_full - (31 - n_r):n_prompt_full]
    assert tok.decode(enc["input_ids"][:32 - n_r]).endswith("### Response:\n")


def test_reject_policy_and_counts(tok):
    short, long_ = msgs("a", "b"), msgs("a", "long " * 100)
    n = encode_example(tok, short, 10_000)["length"]
    assert encode_example(tok, long_, n, "reject") is None
    assert encode_example(tok, short, n, "reject")["truncated"] is False
    assert encode_example(tok, short, n - 1, "reject") is None
    recs = [{"id": "s", "messages": short}, {"id": "l", "messages": long_}]
    kept, rejected = encode_records(tok, recs, n, "reject")
    assert [k["id"] for k in kept] == ["s"] and rejected == [1]


def test_bad_inputs(tok):
    with pytest.raises(InputError, match="truncation"):
        encode_example(tok, msgs("a", "b"), 20, "chop")
    with pytest.raises(InputError, match="assistant"):
        encode_example(tok, [{"role": "user", "content": "hi"}], 20)
    with pytest.raises(InputError, match="messages"):
        encode_example(tok, [{"role": "robot", "content": "hi"}], 20)


def test_collate_pads_to_longest(tok, tiny_pool):
    encs, _ = encode_records(tok, tiny_pool[:5], 256)
    batch = Collator(tok.pad_token_id)(encs)
    longest = max(e["length"] for e in encs)
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape == (5, longest)
    for i, e in enumerate(encs):
        k = e["length"]
        assert batch["input_ids"][i, :k].tolist() == e["input_ids"]
        assert batch["labels"][i, :k].tolist() == e["labels"]
        assert (batch["input_ids"][i, k:] == tok.pad_token_id).all()
        assert (batch["labels"][i, k:] == IGNORE_INDEX).all()
        assert batch["attention_mask"][i].sum().item() == k
    assert batch["input_ids"].dtype == torch.long
    rounded = Collator(tok.pad_token_id, pad_to_multiple_of=16)(encs)
    width = -(-longest // 16) * 16
    assert rounded["input_ids"].shape == (5, width) and width % 16 == 0 and width >= longest
    assert torch.equal(rounded["input_ids"][:, :longest], batch["input_ids"])
    assert (rounded["labels"][:, longest:] == IGNORE_INDEX).all()
    assert torch.equal(rounded["attention_mask"].sum(1), batch["attention_mask"].sum(1))


def test_padding_does_not_change_loss(tok, tiny_model_dir, tiny_pool):
    """Right padding with mask + -100 labels gives the same per-example loss as no padding."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    encs, _ = encode_records(tok, tiny_pool[:3], 256)
    batch = Collator(tok.pad_token_id)(encs)
    with torch.no_grad():
        for i, e in enumerate(encs):
            alone = model(input_ids=torch.tensor([e["input_ids"]]), labels=torch.tensor([e["labels"]])).loss
            padded = model(input_ids=batch["input_ids"][i:i + 1], attention_mask=batch["attention_mask"][i:i + 1],
                           labels=batch["labels"][i:i + 1]).loss
            assert torch.allclose(alone, padded, atol=1e-5)
