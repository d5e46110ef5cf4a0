"""evaluate.py: task YAMLs, and lm-eval end to end on a tiny real model checked against a
direct transformers computation (log-likelihood argmax for multiple choice, greedy decoding
for generation)."""

from __future__ import annotations

import json
import re
import os
from pathlib import Path

import pytest
import yaml

from clusterft.pipeline.errors import InputError
from clusterft.stages.evaluate import DEFAULTS, run_evaluate, write_task_yamls
from clusterft.pipeline.io import set_offline_env, write_jsonl
from clusterft.modeling.prompt import render_prompt

set_offline_env()

WORDS = ("alpha beta gamma delta sort list reverse count upper lower split join fever "
         "patient chapter code").split()
STOPS = DEFAULTS["stop_sequences"]
MAX_GEN = 8


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> str:
    """conftest's tiny pretrained Llama + byte-level BPE tokenizer (bos <s>, eos </s>)."""
    return str(tiny_model_dir)


@pytest.fixture(scope="module")
def random_model_dir(tiny_model_dir, tmp_path_factory) -> str:
    """The tiny model's config and tokenizer with fresh, large random weights: its greedy
    answers vary, where the pretrained one always answers "\n" (empty after stripping)."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    out = tmp_path_factory.mktemp("random_model")
    cfg = AutoConfig.from_pretrained(tiny_model_dir)
    cfg.initializer_range = 0.5  # large weights: clear argmax margins
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    for f in Path(tiny_model_dir).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    return str(out)


def _load(model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def _prompts(n: int, seed: int) -> list[str]:
    import random
    rng = random.Random(seed)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))) for _ in range(n)]
    return [render_prompt([{"role": "user", "content": t}]) for t in texts]


def _choice_logliks(model, tok, prompt: str, choices: list[str]) -> list[float]:
    """Sum of log p(choice tokens | BOS + prompt), choice right after the prompt."""
    import torch
    out = []
    ctx = tok(prompt)["input_ids"]
    for c in choices:
        ids = tok(prompt + c)["input_ids"]
        assert ids[:len(ctx)] == ctx  # the choice starts a new token
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0], -1)
        out.append(float(sum(logp[i - 1, ids[i]] for i in range(len(ctx), len(ids)))))
    return out


def _greedy(model, tok, prompt: str) -> str:
    """Greedy continuation, cut at the first stop sequence and stripped."""
    import torch
    ids = torch.tensor([tok(prompt)["input_ids"]])
    with torch.no_grad():
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_GEN,
                             do_sample=False, pad_token_id=tok.pad_token_id)
    text = tok.decode(gen[0, ids.shape[1]:].tolist(), skip_special_tokens=True)
    for s in STOPS:
        text = text.split(s)[0]
    return text.strip()


def _write_bench(bench: Path, hf, generation: bool = True) -> tuple[float, float]:
    """A 10-item MC task and a 10-item generation task whose expected scores are known:
    MC labels are the model's own argmax for 7 items and another choice for 3 (acc 0.7);
    generation answers are the model's own greedy output for 6 items, a wrong string for 4
    (exact match 0.6)."""
    model, tok = hf
    mc = []
    for i, p in enumerate(_prompts(10, 1)):
        choices = [WORDS[(i + k) % len(WORDS)] for k in range(4)]
        ll = _choice_logliks(model, tok, p, choices)
        best = max(range(4), key=ll.__getitem__)
        mc.append({"id": f"mc-{i}", "prompt": p, "choices": choices,
                   "label": best if i < 7 else (best + 1) % 4})
    write_jsonl(bench / "mc_task.jsonl", mc)
    if generation:
        gen = []
        for i, p in enumerate(_prompts(10, 2)):
            out = _greedy(model, tok, p)
            gen.append({"id": f"gen-{i}", "prompt": p,
                        "answer": out if i < 6 else out + "#wrong"})
        assert sum(bool(g["answer"]) for g in gen[:6]) >= 4, "greedy answers too often empty"
        write_jsonl(bench / "gen_task.jsonl", gen)
    return 0.7, 0.6


def test_end_to_end_matches_direct_computation(tmp_path, random_model_dir):
    bench = tmp_path / "bench"
    exp_mc, exp_gen = _write_bench(bench, _load(random_model_dir))
    out = tmp_path / "eval" / "results.json"
    cfg = {"batch_size": 1, "max_gen_toks": MAX_GEN, "num_threads": 1}
    res = run_evaluate(random_model_dir, ["mc_task", "gen_task"], bench, cfg, out,
                       tmp_path / "tasks", seed=0, out_items=tmp_path / "eval" / "items.parquet")
    on_disk = json.loads(out.read_text())
    # per-item results: the items built right (mc 0-6, gen 0-5) score 1, the others 0
    import pandas as pd

    items = pd.read_parquet(tmp_path / "eval" / "items.parquet").sort_values(["task", "doc_id"])
    assert list(items.columns) == ["task", "doc_id", "item", "value"]
    got = dict(zip(items["item"], items["value"]))
    assert got == {**{f"mc-{i}": float(i < 7) for i in range(10)},
                   **{f"gen-{i}": float(i < 6) for i in range(10)}}
    assert on_disk["tasks"] == res["tasks"]
    assert set(on_disk["tasks"]) == {"mc_task", "gen_task"}
    mc, gen = on_disk["tasks"]["mc_task"], on_disk["tasks"]["gen_task"]
    assert (mc["metric"], mc["n"]) == ("acc", 10)
    assert (gen["metric"], gen["n"]) == ("exact_match", 10)
    assert mc["value"] == pytest.approx(exp_mc, abs=1e-9)
    assert gen["value"] == pytest.approx(exp_gen, abs=1e-9)
    assert on_disk["average"] == pytest.approx((exp_mc + exp_gen) / 2)
    for t in (mc, gen):
        assert 0 < t["stderr"] < 1
    raw = json.loads((out.parent / "results.lm_eval.json").read_text())
    assert raw["results"]["mc_task"]["acc,none"] == pytest.approx(exp_mc)
    assert raw["pretty_env_info"].startswith("skipped") and raw["lm_eval_version"]
    assert sorted(p.name for p in (tmp_path / "tasks").glob("*.yaml")) == ["gen_task.yaml",
                                                                          "mc_task.yaml"]


def test_batched_and_limited_run(tmp_path, model_dir):
    """On the pretrained tiny model, batch size 4 gives the MC accuracy of the direct
    computation (right padding only); limit caps n."""
    bench = tmp_path / "bench"
    exp_mc, _ = _write_bench(bench, _load(model_dir), generation=False)
    out = tmp_path / "r.json"
    res = run_evaluate(model_dir, ["mc_task"], bench, {"batch_size": 4, "num_threads": 1}, out,
                       tmp_path / "tasks")
    assert res["tasks"]["mc_task"]["value"] == pytest.approx(exp_mc)
    res = run_evaluate(model_dir, ["mc_task"], bench, {"limit": 3, "num_threads": 1}, out,
                       tmp_path / "tasks")
    assert res["tasks"]["mc_task"]["n"] == 3


def test_lm_eval_adds_exactly_one_bos(model_dir):
    from lm_eval.models.huggingface import HFLM
    lm = HFLM(pretrained=model_dir, device="cpu", batch_size=1)
    bos = lm.tokenizer.bos_token_id
    prompt = _prompts(1, 3)[0]
    enc = lm.tok_encode(prompt)
    assert enc[0] == bos and enc.count(bos) == 1
    ctx, cont = lm._encode_pair(prompt, "alpha")
    assert ctx[0] == bos and (ctx + cont).count(bos) == 1
    ids, _ = lm.tok_batch_encode([prompt, prompt + " beta"])
    assert [row.tolist().count(bos) for row in ids] == [1, 1]


def _items(tmp_path: Path) -> Path:
    bench = tmp_path / "bench"
    write_jsonl(bench / "mc.jsonl", [{"id": "a", "prompt": "### Instruction:\n1\n\n### Response:\n",
                                      "choices": ["x", "y"], "label": 1}])
    write_jsonl(bench / "gen.jsonl", [{"id": "b", "prompt": "12\n", "answer": "[1, 2]"}])
    return bench


def test_task_yamls_absolute_paths_and_types(tmp_path, monkeypatch):
    bench = _items(tmp_path)
    monkeypatch.chdir(tmp_path)
    paths = write_task_yamls([{"name": "mc", "output_type": "multiple_choice"},
                              {"name": "gen", "output_type": "generate_until"}],
                             "bench", "tasks", {"max_gen_toks": 5})
    mc, gen = (yaml.safe_load(Path(p).read_text()) for p in paths)
    for doc, name in ((mc, "mc"), (gen, "gen")):
        data = doc["dataset_kwargs"]["data_files"]["test"]
        assert os.path.isabs(data) and Path(data) == (bench / f"{name}.jsonl").resolve()
        assert doc["task"] == name and doc["dataset_path"] == "json"
        assert doc["test_split"] == "test" and doc["unsafe_code"] is False
    assert mc["output_type"] == "multiple_choice" and mc["metric_list"][0]["metric"] == "acc"
    assert gen["output_type"] == "generate_until"
    assert gen["generation_kwargs"] == {"until": STOPS, "do_sample": False, "max_gen_toks": 5}
    assert gen["metric_list"][0]["metric"] == "exact_match"

    # lm-eval reads them as intended: text and targets pass through untouched (a "[1, 2]"
    # answer stays a string, a digit-only prompt is not turned into an int).
    from lm_eval.tasks import TaskManager
    tasks = TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False
                        ).load(["mc", "gen"])["tasks"]
    mdoc = next(iter(tasks["mc"].test_docs()))
    gdoc = next(iter(tasks["gen"].test_docs()))
    assert tasks["mc"].doc_to_text(mdoc).endswith("### Response:\n")
    assert tasks["mc"].doc_to_target(mdoc) == 1 and tasks["mc"].doc_to_choice(mdoc) == ["x", "y"]
    assert tasks["gen"].doc_to_text(gdoc) == "12\n"
    assert tasks["gen"].doc_to_target(gdoc) == "[1, 2]"


def test_output_type_inferred_without_registry(tmp_path):
    bench = _items(tmp_path)
    paths = write_task_yamls(["mc", "gen"], bench, tmp_path / "t")
    types = [yaml.safe_load(Path(p).read_text())["output_type"] for p in paths]
    assert types == ["multiple_choice", "generate_until"]


def test_bad_items_name_file_line_field(tmp_path):
    bench = tmp_path / "bench"
    write_jsonl(bench / "mc.jsonl", [{"id": "a", "prompt": "p", "choices": ["x", "y"], "label": 0},
                                     {"id": "b", "prompt": "p", "choices": ["x", "y"], "label": 2}])
    with pytest.raises(InputError, match=r"mc\.jsonl, line 2, field 'label'"):
        write_task_yamls([{"name": "mc", "output_type": "multiple_choice"}], bench, tmp_path / "t")
    with pytest.raises(InputError, match="unknown key"):
        write_task_yamls(["mc"], bench, tmp_path / "t", {"batchsize": 3})


def test_unsafe_code_needs_confirmation(tmp_path, model_dir):
    bench = _items(tmp_path)
    spec = {"name": "gen", "output_type": "generate_until", "unsafe_code": True}
    (path,) = write_task_yamls([spec], bench, tmp_path / "t")
    assert yaml.safe_load(Path(path).read_text())["unsafe_code"] is True
    with pytest.raises(InputError, match="confirm_run_unsafe_code"):
        run_evaluate(model_dir, [spec], bench, {}, tmp_path / "r.json", tmp_path / "t")


def test_paced_model_gives_hf_results_and_logs_its_pace(tmp_path, random_model_dir, monkeypatch,
                                                         capfd):
    """clusterft-hf (lm-eval's hf with pace lines) scores exactly as lm-eval's own hf, and
    writes a pace line per request type to stderr (the rule's log)."""
    from clusterft.stages import evaluate

    bench = tmp_path / "bench"
    _write_bench(bench, _load(random_model_dir))
    cfg = {"batch_size": 2, "max_gen_toks": MAX_GEN, "num_threads": 1}
    paced = run_evaluate(random_model_dir, ["mc_task", "gen_task"], bench, cfg,
                         tmp_path / "a" / "results.json", tmp_path / "ta", seed=0)
    err = capfd.readouterr().err
    assert re.search(r"pace evaluate loglikelihood: request \d+/\d+, [\d.e-]+ s/request", err), err
    assert re.search(r"pace evaluate generate_until: \d+ requests in", err), err
    raw = json.loads((tmp_path / "a" / "results.lm_eval.json").read_text())
    assert raw["config"]["model"] == evaluate.PACED_MODEL
    monkeypatch.setattr(evaluate, "_register_paced_model", lambda: "hf")
    plain = run_evaluate(random_model_dir, ["mc_task", "gen_task"], bench, cfg,
                         tmp_path / "b" / "results.json", tmp_path / "tb", seed=0)
    assert "pace evaluate" not in capfd.readouterr().err
    assert paced["tasks"] == plain["tasks"] and paced["average"] == plain["average"]


def test_several_models_in_one_process_equal_a_process_each(tmp_path, model_dir,
                                                            random_model_dir):
    """run_evaluate_many (the workflow's evaluate_seeds jobs): each model's outputs, the
    second one's evaluated after the first in the same process, equal those of a process
    evaluating it alone; mismatched lists and a missing model are refused before any work."""
    import subprocess
    import sys

    import pandas as pd

    from clusterft.stages.evaluate import run_evaluate_many

    bench = tmp_path / "bench"
    _write_bench(bench, _load(random_model_dir))
    cfg = {"batch_size": 2, "max_gen_toks": MAX_GEN, "num_threads": 1}
    tasks = ["mc_task", "gen_task"]
    out = [tmp_path / f"m{i}" / "results.json" for i in (0, 1)]
    items = [p.with_name("items.parquet") for p in out]
    tdirs = [p.with_name("tasks") for p in out]
    many = run_evaluate_many([model_dir, random_model_dir], tasks, bench, cfg, out, tdirs,
                             seeds=[0, 1], out_items=items)
    assert [m["meta"]["seed"] for m in many] == [0, 1]
    alone = tmp_path / "alone" / "results.json"
    code = ("import sys, json; from clusterft.stages.evaluate import run_evaluate; "
            "run_evaluate(sys.argv[1], ['mc_task', 'gen_task'], sys.argv[2], "
            "json.loads(sys.argv[3]), sys.argv[4], sys.argv[5], seed=1, out_items=sys.argv[6])")
    proc = subprocess.run([sys.executable, "-c", code, random_model_dir, str(bench),
                           json.dumps(cfg), str(alone), str(alone.with_name("tasks")),
                           str(alone.with_name("items.parquet"))],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, ref = json.loads(out[1].read_text()), json.loads(alone.read_text())
    assert got["tasks"] == ref["tasks"] and got["average"] == ref["average"]
    pd.testing.assert_frame_equal(pd.read_parquet(items[1]),
                                  pd.read_parquet(alone.with_name("items.parquet")))
    # the two models answer differently (the pretrained one always "\n")
    assert json.loads(out[0].read_text())["tasks"] != got["tasks"]
    with pytest.raises(InputError, match="seeds"):
        run_evaluate_many([model_dir, random_model_dir], tasks, bench, cfg, out, tdirs,
                          seeds=[0])
    with pytest.raises(InputError, match="config.json"):
        run_evaluate_many([model_dir, str(tmp_path / "missing")], tasks, bench, cfg,
                          [tmp_path / "x" / f"r{i}.json" for i in (0, 1)],
                          [tmp_path / "x" / f"t{i}" for i in (0, 1)], seeds=[0, 1])
    assert not (tmp_path / "x").exists()


def test_a_lora_adapter_evaluates_like_its_merged_model(tmp_path, random_model_dir):
    """LoRA runs save only the peft adapter; lm-eval loads the base with it (`peft=`) and must
    score every item as the merged model does."""
    import torch
    from transformers import AutoModelForCausalLM

    from clusterft.modeling.hf import load_tokenizer, save_adapter_dir, save_model_dir
    from clusterft.modeling.lora import add_lora
    from clusterft.stages.evaluate import lm_eval_model_args

    tok = load_tokenizer(random_model_dir)
    torch.manual_seed(1)
    model = add_lora(AutoModelForCausalLM.from_pretrained(random_model_dir),
                     {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]},
                     "train.lora")
    with torch.no_grad():  # a trained-looking adapter: B away from its zero init
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    save_adapter_dir(model, tok, tmp_path / "adapter")
    save_model_dir(model, tok, tmp_path / "merged")  # merges
    args = lm_eval_model_args(tmp_path / "adapter", DEFAULTS)
    assert (args["pretrained"], args["peft"]) == (random_model_dir, str(tmp_path / "adapter"))

    bench = tmp_path / "bench"
    _write_bench(bench, _load(str(tmp_path / "merged")))
    cfg = {"batch_size": 1, "max_gen_toks": MAX_GEN, "num_threads": 1}
    got = {}
    for name in ("adapter", "merged"):
        res = run_evaluate(str(tmp_path / name), ["mc_task", "gen_task"], bench, cfg,
                           tmp_path / name / "eval.json", tmp_path / "tasks", seed=0)
        got[name] = {t: v["value"] for t, v in res["tasks"].items()}
    assert got["adapter"] == got["merged"]
    assert got["merged"]["mc_task"] == pytest.approx(0.7) and got["merged"]["gen_task"] == pytest.approx(0.6)
