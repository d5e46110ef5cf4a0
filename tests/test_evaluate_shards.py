"""evaluate.shards: a run's tasks evaluated in several jobs and merged give the outputs of one
job (real tiny model, real lm-eval); the evaluate config's new keys are validated; the
workflow plans shard jobs and their merges only when asked."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from clusterft.plan.config import validate_schema
from clusterft.pipeline.errors import InputError
from clusterft.stages.evaluate import merge_cfg, merge_shards, run_evaluate, shard_tasks
from clusterft.pipeline.io import set_offline_env, write_jsonl
from clusterft.modeling.prompt import render_prompt

set_offline_env()
ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / ".test" / "config.yaml"
WORDS = "alpha beta gamma delta sort list reverse count upper lower fever patient".split()
TASKS = ["mc_a", "gen_b", "mc_c"]
CFG = {"batch_size": 4, "max_gen_toks": 6, "num_threads": 1}


def test_shard_tasks_deals_round_robin_and_never_makes_empty_shards():
    assert shard_tasks(["a", "b", "c", "d", "e"], 2) == [["a", "c", "e"], ["b", "d"]]
    assert shard_tasks(["a", "b", "c"], 1) == [["a", "b", "c"]]
    assert shard_tasks(["a", "b"], 5) == [["a"], ["b"]]
    for bad in (0, -1, True, 1.5):
        with pytest.raises(InputError, match="evaluate.shards"):
            shard_tasks(["a"], bad)


def _bench(folder: Path) -> None:
    """Two multiple-choice tasks (random labels) and one generation task (half the answers
    empty, which the tiny model's stripped greedy output often is)."""
    rng = random.Random(0)

    def prompt() -> str:
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8)))
        return render_prompt([{"role": "user", "content": text}])

    for name in ("mc_a", "mc_c"):
        write_jsonl(folder / f"{name}.jsonl", [
            {"id": f"{name}-{i}", "prompt": prompt(), "choices": rng.sample(WORDS, 3),
             "label": rng.randrange(3)} for i in range(12)])
    write_jsonl(folder / "gen_b.jsonl", [
        {"id": f"gen_b-{i}", "prompt": prompt(), "answer": "" if i % 2 else "alpha"}
        for i in range(8)])


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir):
    """The same three tasks evaluated in one job, and in two shards then merged."""
    tmp = tmp_path_factory.mktemp("shards")
    bench = tmp / "bench"
    _bench(bench)
    one = tmp / "one"
    run_evaluate(tiny_model_dir, TASKS, [bench], CFG, one / "results.json", one / "tasks",
                 seed=0, out_items=one / "items.parquet")
    groups = shard_tasks(TASKS, 2)
    shard_json = []
    for i, group in enumerate(groups):
        d = tmp / "two" / "shards" / f"{i}-of-{len(groups)}"
        run_evaluate(tiny_model_dir, group, [bench], CFG, d / "results.json", d / "tasks",
                     seed=0, out_items=d / "items.parquet")
        shard_json.append(d / "results.json")
    two = tmp / "two"
    merge_shards(shard_json, TASKS, [bench], {**CFG, "shards": 2}, two / "results.json",
                 two / "tasks", seed=0, out_items=two / "items.parquet")
    return {"one": one, "two": two, "bench": bench, "shards": shard_json, "tmp": tmp}


def test_merged_shards_equal_one_job(runs):
    one, two = runs["one"], runs["two"]
    a = json.loads((one / "results.json").read_text())
    b = json.loads((two / "results.json").read_text())
    assert list(a["tasks"]) == list(b["tasks"]) == TASKS
    assert a["tasks"] == b["tasks"] and a["average"] == b["average"]
    assert b["meta"]["shards"] == [["mc_a", "mc_c"], ["gen_b"]]
    assert {k: a["meta"][k] for k in ("model_dir", "seed", "limit", "batch_size")} == \
        {k: b["meta"][k] for k in ("model_dir", "seed", "limit", "batch_size")}
    # the runs are not trivial: accuracies off 0 and 1, the generation task partly right
    assert all(0 < t["value"] < 1 for t in a["tasks"].values()), a["tasks"]
    ia, ib = pd.read_parquet(one / "items.parquet"), pd.read_parquet(two / "items.parquet")
    pd.testing.assert_frame_equal(ia, ib)
    assert len(ia) == 12 + 8 + 12
    ra = json.loads((one / "results.lm_eval.json").read_text())
    rb = json.loads((two / "results.lm_eval.json").read_text())
    for key in ("results", "n-samples", "versions", "higher_is_better", "n-shot"):
        assert ra[key] == rb[key], key
    # task configs: the same, each naming its own run's task YAML
    as_one = json.loads(json.dumps(rb["configs"]).replace(str(two), str(one)))
    assert ra["configs"] == as_one
    assert rb["configs"]["gen_b"]["metadata"]["config_source"] == str(two / "tasks" / "gen_b.yaml")
    assert rb["clusterft_shards"] == [["mc_a", "mc_c"], ["gen_b"]]
    # the same task YAMLs (absolute paths to the same item files)
    files = sorted(p.name for p in (one / "tasks").iterdir())
    assert files == sorted(p.name for p in (two / "tasks").iterdir())
    assert {f"{t}.yaml" for t in TASKS} <= set(files)
    for f in files:
        assert (one / "tasks" / f).read_bytes() == (two / "tasks" / f).read_bytes(), f
    prov = json.loads((two / "results.json.provenance.json").read_text())
    assert prov["stage"] == "evaluate" and "tokenizer" in prov["lineage"]


def _copy_shard(src: Path, dst: Path, edit=None) -> Path:
    """A shard folder copied without its provenance sidecars (as a user's own files); `edit`
    changes its results.json."""
    shutil.copytree(src.parent, dst)
    for sc in dst.rglob("*.provenance.json"):
        sc.unlink()
    if edit:
        doc = json.loads((dst / "results.json").read_text())
        edit(doc)
        (dst / "results.json").write_text(json.dumps(doc))
    return dst / "results.json"


def test_merge_refuses_missing_duplicate_and_mismatched_shards(runs, tmp_path):
    s0, s1 = runs["shards"]
    args = (TASKS, [runs["bench"]], CFG)
    out = tmp_path / "m"
    with pytest.raises(InputError, match=r"no shard evaluated tasks \['gen_b'\]"):
        merge_shards([s0], *args, out / "results.json", out / "tasks", out_items=out / "i.parquet")
    with pytest.raises(InputError, match="task 'mc_a' is also in shard"):
        merge_shards([s0, s1, s0], *args, out / "results.json", out / "tasks")
    other_seed = _copy_shard(s1, tmp_path / "seed1",
                             lambda d: d["meta"].update(seed=1))
    with pytest.raises(InputError, match=r"seed1.*field 'meta.seed'|differ in seed"):
        merge_shards([s0, other_seed], *args, out / "results.json", out / "tasks")
    wrong = _copy_shard(s1, tmp_path / "wrong",
                        lambda d: d["tasks"]["gen_b"].update(value=0.999))
    with pytest.raises(InputError, match="per-item scores do not give"):
        merge_shards([s0, wrong], *args, out / "results.json", out / "tasks",
                     out_items=out / "i.parquet")
    assert not (out / "results.json").exists()


def test_evaluate_section_values_are_checked_with_field_names(tmp_path):
    assert merge_cfg({})["shards"] == 1 and merge_cfg({})["parallelize"] is False
    cases = [({"shards": 0}, "evaluate.shards"), ({"gpus": 0}, "evaluate.gpus"),
             ({"batch_size": 0}, "evaluate.batch_size"), ({"dtype": "fp8"}, "evaluate.dtype"),
             ({"gpus": 2}, "evaluate.gpus"), ({"parallelize": True, "device": "cpu"},
                                             "evaluate.parallelize"),
             ({"parallelize": "yes"}, "evaluate.parallelize"), ({"shards": 1.5}, "evaluate.shards")]
    for cfg, field in cases:
        with pytest.raises(InputError, match=field.replace(".", r"\.")):
            merge_cfg(cfg)
    assert merge_cfg({"gpus": 4, "parallelize": True, "dtype": "bfloat16"})["gpus"] == 4
    # through the config check: the file, line and field
    doc = yaml.safe_load(SMOKE.read_text())
    doc["evaluate"] = {"batch_size": 16, "dtype": "half"}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    with pytest.raises(InputError, match=r"c\.yaml, line \d+, field 'evaluate\.dtype'.*half"):
        validate_schema(yaml.safe_load(path.read_text()), source=str(path))


def _without(doc: dict, dataset: str) -> dict:
    """The smoke config ``doc`` without ``dataset``: the sweep groups that name it lose it,
    and a group left with no dataset goes (the step-matched arm, the curve and the
    distribution ablation run on the testbed only)."""
    doc["datasets"].pop(dataset)
    for name in ("baselines", "curve", "distribution_ablation", "step_matched", "time"):
        group = doc["sweep"].get(name)
        if group and "datasets" in group:
            group["datasets"] = [d for d in group["datasets"] if d != dataset]
            if not group["datasets"]:
                doc["sweep"].pop(name)
    return doc


def _dry_run(tmp_path: Path, evaluate: dict) -> str:
    """The smoke config without its testbed (one task per run: nothing to shard)."""
    doc = _without(yaml.safe_load(SMOKE.read_text()), "cipher")
    doc["evaluate"] = evaluate
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump(doc, sort_keys=False))
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "-n", "-p",
         "--directory", str(tmp_path), "--configfile", str(cfg), "--cores", "2"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _job_counts(text: str) -> dict[str, int]:
    stats = text.split("Job stats:", 1)[1].split("Reasons:", 1)[0]
    out = {}
    for line in stats.splitlines()[3:]:
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit() and parts[0] != "total":
            out[parts[0]] = int(parts[1])
    return out


def test_workflow_plans_shards_and_merges_only_when_asked(tmp_path):
    """Default: one evaluate job per run (the smoke config fuses a one-rank run's seeds:
    evaluate_seeds, one job for all of them). shards 2: each seed's 3 tasks in 2 shard jobs
    (one GPU each on a GPU cluster; none here) and a CPU-only merge under the rule name
    evaluate; shards 5: never more shards than tasks."""
    plain = _job_counts(_dry_run(tmp_path / "a", {"batch_size": 16}))
    runs = plain["evaluate_seeds"] * len(yaml.safe_load(SMOKE.read_text())["seeds"])
    assert "evaluate_shard" not in plain and runs > 0
    text = _dry_run(tmp_path / "b", {"batch_size": 16, "shards": 2})
    sharded = _job_counts(text)
    assert "evaluate_seeds" not in sharded and sharded["evaluate"] == runs
    assert sharded["evaluate_base"] == plain["evaluate_base"]
    assert sharded["evaluate_shard"] == 2 * runs
    assert sharded["evaluate_base_shard"] == 2 * plain["evaluate_base"]
    assert "results/eval/skills/tiny/base/shards/1-of-2/items.parquet" in text
    many = _job_counts(_dry_run(tmp_path / "c", {"batch_size": 16, "shards": 5}))
    assert many["evaluate_shard"] == 3 * runs


def test_workflow_runs_shards_and_merges_like_one_job(tmp_path, tiny_model_dir,
                                                      tiny_tokenizer_dir):
    """The rules for real on the tiny model (source: path) and a small skills pool: the
    base model's evaluation in 2 shard jobs and a merge, equal to run_evaluate in one go."""
    doc = _without(_without(yaml.safe_load(SMOKE.read_text()), "cipher"), "icd10")
    doc["datasets"] = {"skills": {**doc["datasets"]["skills"], "n": 120, "items_per_task": 10}}
    doc["tasks"] = {"items_per_task": 10}
    doc["tokenizer"] = {"source": "path", "path": str(tiny_tokenizer_dir)}
    doc["models"] = {"tiny": {"source": "path", "path": str(tiny_model_dir)}}
    doc["evaluate"] = {**CFG, "shards": 2}
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump(doc, sort_keys=False))
    target = "results/eval/skills/tiny/base/results.json"
    proc = subprocess.run(
        [sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "--directory",
         str(tmp_path), "--configfile", str(cfg), "--cores", "2", target],
        capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    base = tmp_path / "results/eval/skills/tiny/base"
    shards = sorted(p.name for p in (base / "shards").iterdir())
    assert shards == ["0-of-2", "1-of-2"]
    merged = json.loads((base / "results.json").read_text())
    one = tmp_path / "one"
    direct = run_evaluate(tmp_path / "results/models/tiny/base", list(merged["tasks"]),
                          [tmp_path / "results/tasks/skills"], doc["evaluate"],
                          one / "results.json", one / "tasks", seed=0,
                          out_items=one / "items.parquet")
    assert len(merged["tasks"]) == 3 and merged["tasks"] == direct["tasks"]
    assert merged["meta"]["shards"] == [list(merged["tasks"])[0::2], list(merged["tasks"])[1::2]]
    pd.testing.assert_frame_equal(pd.read_parquet(base / "items.parquet"),
                                  pd.read_parquet(one / "items.parquet"))
    listing = [sorted(p.name for p in d.iterdir() if not p.name.startswith("."))
               for d in (base / "tasks", one / "tasks")]
    assert listing[0] == listing[1] and len(listing[0]) >= 3
