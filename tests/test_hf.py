"""Model and tokenizer folders as real checkpoints ship them (clusterft.modeling.hf).

Llama-2's tokenizer has no pad token: a paper run stopped at the first stage that loaded
it. A Llama-2-shaped tokenizer is made here from the tiny test tokenizer by removing its
pad, exactly as such a folder is written (`tokenizer_config.json` without `pad_token`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from clusterft.modeling.hf import load_tokenizer
from clusterft.pipeline.errors import InputError


def _without(tokenizer_dir: Path, dest: Path, *keys: str) -> Path:
    """A copy of a tokenizer/model folder whose tokenizer_config.json lacks ``keys``."""
    shutil.copytree(tokenizer_dir, dest)
    cfg_path = dest / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    for k in keys:
        cfg.pop(k, None)
    cfg_path.write_text(json.dumps(cfg), encoding="utf-8")
    return dest


def test_a_tokenizer_without_pad_gets_its_eos_as_pad(tiny_tokenizer_dir, tmp_path):
    llama2 = _without(tiny_tokenizer_dir, tmp_path / "llama2", "pad_token")
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(llama2)).pad_token_id is None  # as shipped
    tok = load_tokenizer(llama2)
    assert tok.pad_token_id == tok.eos_token_id is not None
    assert tok.padding_side == "right"
    assert load_tokenizer(tiny_tokenizer_dir).pad_token_id != tok.eos_token_id  # own pad kept


def test_a_tokenizer_without_eos_is_refused(tiny_tokenizer_dir, tmp_path):
    bad = _without(tiny_tokenizer_dir, tmp_path / "noeos", "eos_token")
    with pytest.raises(InputError, match="no eos"):
        load_tokenizer(bad)


def test_eos_as_pad_trains_and_scores_like_a_real_pad(tiny_model_dir, tiny_pool, tmp_path):
    """Padding is masked by position, so per-example losses are the same whichever id pads,
    and the eos that ends each response keeps its label (it is not taken for padding)."""
    import torch
    from transformers import AutoModelForCausalLM

    from clusterft.modeling.tokenize import collate, encode_truncated

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    own = load_tokenizer(tiny_model_dir)
    llama2 = load_tokenizer(_without(tiny_model_dir, tmp_path / "m", "pad_token"))
    enc, _ = encode_truncated(llama2, tiny_pool[:8], 128)
    assert any(e["labels"][-1] == llama2.eos_token_id for e in enc)

    def losses(pad_id):
        b = collate(enc, pad_id)
        with torch.no_grad():
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        lp = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), b["labels"][:, 1:],
                                               reduction="none")
        keep = (b["labels"][:, 1:] != -100)
        assert keep.sum() == sum(sum(x != -100 for x in e["labels"][1:]) for e in enc)
        return (lp * keep).sum(1) / keep.sum(1)

    torch.testing.assert_close(losses(llama2.pad_token_id), losses(own.pad_token_id),
                               rtol=1e-5, atol=1e-6)


def test_the_base_loads_in_the_dtype_the_run_asks(tiny_model_dir):
    import torch

    from clusterft.modeling.hf import load_causal_lm

    assert {p.dtype for p in load_causal_lm(tiny_model_dir).parameters()} == {torch.float32}
    bf = load_causal_lm(tiny_model_dir, dtype=torch.bfloat16, device="cpu")
    assert {p.dtype for p in bf.parameters()} == {torch.bfloat16}
    assert {p.device.type for p in bf.parameters()} == {"cpu"}


@pytest.mark.parametrize("precision, device, finetune, want", [
    ("bf16", "cuda", "lora", "bfloat16"),   # frozen base on a GPU: half the memory
    ("bf16", "cuda", "full", "float32"),    # weights that learn keep float32
    ("fp32", "cuda", "lora", "float32"),
    ("bf16", "cpu", "lora", "float32"),     # CPU bf16 is autocast over float32 weights
    ("fp32", "cpu", "full", "float32"),
])
def test_base_dtype_rule(precision, device, finetune, want):
    from clusterft.modeling.precision import base_dtype

    assert str(base_dtype(precision, device, finetune)).removeprefix("torch.") == want
