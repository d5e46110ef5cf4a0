"""The workflow end to end on the smoke config (.test/config.yaml), then rerun behaviour.

Runs the real Snakefile in a temporary working directory: every rule, torchrun ranks,
lm-eval, the report. Then checks that a completed run reruns nothing and that changing
`cluster.k` reruns `cluster` and what follows, but not `score`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from clusterft.pipeline.names import STEPS_LABEL
import yaml

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / ".test" / "config.yaml"


def snakemake(workdir: Path, *args: str, check: bool = True,
              configfile: Path = SMOKE) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    cmd = [sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "--directory",
           str(workdir), "--configfile", str(configfile), "--cores", "2", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=workdir)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}")
    return proc


def planned_rules(workdir: Path, *args: str, configfile: Path = SMOKE) -> dict[str, int]:
    """Rule -> job count that a dry run would execute (from Snakemake's job stats table)."""
    out = snakemake(workdir, "-n", *args, configfile=configfile)
    text = out.stdout + out.stderr
    if "Nothing to be done" in text:
        return {}
    stats = text.split("Job stats:", 1)[1]
    rules = {}
    for line in stats.splitlines():
        m = re.match(r"^(\w+)\s+(\d+)\s*$", line.strip())
        if m and m.group(1) != "total":
            rules[m.group(1)] = int(m.group(2))
    return rules


# `smoke_run` (tests/conftest.py): one finished run of the smoke config, shared by the
# session (test_slurm.py compares its SLURM run against it).


def test_outputs_exist_and_are_real(smoke_run: Path) -> None:
    tables = smoke_run / "results" / "tables"
    acc = pd.read_csv(tables / "accuracy_vs_data.csv")
    assert set(acc["dataset"]) == {"skills", "icd10", "cipher"}
    assert {"full", "random", "cluster"} <= set(acc["method"])
    # the step-matched arm, on the testbed only: rows of their own beside the protocol's
    steps = acc[acc["method"].str.endswith(STEPS_LABEL)]
    assert set(zip(steps["dataset"], steps["method"])) == {
        ("cipher", "random" + STEPS_LABEL), ("cipher", "oracle" + STEPS_LABEL)}
    assert acc["average_mean"].between(0, 1).all()
    time = pd.read_csv(tables / "time.csv")
    # balanced_steps: the step-matched arm's runs, timed like the rest under their own label
    assert set(time["distribution"]) == {"random", "balanced", "balanced_steps"}
    assert (time["wall_time_s_mean"] > 0).all()
    for d in ("skills", "icd10", "cipher"):
        for p in ("accuracy_vs_data", "time", "comparisons"):
            png = smoke_run / "results" / "plots" / f"{p}_{d}.png"
            assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    runs = [(p.parent.parent.name, json.loads(p.read_text()))
            for p in (smoke_run / "results" / "train").rglob("train_metrics.json")]
    # g1-random: the distribution ablation (the method's selection, shuffled batches)
    # g1-balanced_steps: the step-matched arm (full data's steps)
    assert {run for run, _ in runs} == {"g1-balanced", "g1-random", "g2-balanced", "g2-random",
                                        "g1-balanced_steps"}
    for run, metrics in runs:  # accuracy runs on one rank, time runs on 2 under torchrun
        assert metrics["world_size"] == (1 if run.startswith("g1") else 2) and metrics["steps"] > 0
        assert metrics["backend"] == (None if run.startswith("g1") else "gloo")
        assert metrics["step_budget"] == ("pool" if run.endswith("_steps") else "selection")
        assert metrics["distribution"] == run.split("-")[1].removesuffix("_steps")
    full = {json.loads(p.read_text())["steps"] for p in (smoke_run / "results" / "train" / "cipher"
                                                          ).glob("tiny/full-1/g1-balanced/s0/train_metrics.json")}
    matched = {json.loads(p.read_text())["steps"] for p in (smoke_run / "results" / "train" / "cipher"
                                                             ).glob("tiny/*-0.31/g1-balanced_steps/s0/train_metrics.json")}
    assert len(full) == 1 and matched == full  # every step-matched run trains full data's steps
    # every pool x every benchmark task of every dataset, nothing overlapping left
    cont = pd.read_csv(tables / "contamination.csv")
    from clusterft.tasks.registry import TASKS

    datasets = ("skills", "icd10", "cipher")
    tasks = {t for t, spec in TASKS.items() if spec.dataset in datasets}
    assert set(zip(cont["dataset"], cont["task"])) == {(d, t) for d in datasets for t in tasks}
    assert (cont["remaining"] == 0).all() and (cont["action"] == "drop").all()
    # every rule wrote a log and a benchmark file
    for rule in ("prepare_data", "decontaminate", "score", "features", "cluster", "select",
                 "train", "evaluate"):
        assert list((smoke_run / "logs" / rule).rglob("*.log")), rule
        assert list((smoke_run / "benchmarks" / "out" / rule).rglob("*.tsv")), rule


def test_every_method_feature_kind_and_verdict_table(smoke_run: Path) -> None:
    """The smoke config walks every method and feature kind of the embedded default, and
    the report turns them into the skill-recovery, label, comparison and claims tables."""
    from clusterft.pipeline.names import FEATURE_KINDS, METHODS, REFERENCES

    tables = smoke_run / "results" / "tables"
    acc = pd.read_csv(tables / "accuracy_vs_data.csv")
    assert set(acc["method"]) == set(METHODS) | {"base"} | {
        m + STEPS_LABEL for m in ("random", "oracle")}
    assert sorted(acc[(acc["method"] == "cluster") & (acc["dataset"] == "cipher")]["fraction"]) \
        == [0.31, 0.5]  # the curve, on the testbed only (as config/config.yaml)
    assert sorted(acc[(acc["method"] == "cluster") & (acc["dataset"] == "skills")]["fraction"]) \
        == [0.31]
    # the baselines where the smoke config asks for them (sweep.baselines), not on icd10
    assert set(acc[acc["dataset"] == "icd10"]["method"]) == {"base", "full", "random", "cluster",
                                                             "oracle"}
    rs2_cipher = pd.read_parquet(smoke_run / "results/select/cipher/tiny/rs2-0.31/s0/"
                                 "selection.parquet")
    assert rs2_cipher["epoch"].nunique() == 2  # the testbed's own epochs (datasets.cipher.train)
    sr = pd.read_csv(tables / "skill_recovery.csv")
    assert set(sr["features"]) == set(FEATURE_KINDS) and sr["ari"].between(-1, 1).all()
    assert {"nmi", "purity", "label_coverage"} <= set(sr.columns)
    lc = pd.read_csv(tables / "label_counts.csv")
    assert set(lc["method"]) == set(METHODS) - {"full"}
    cmp = pd.read_csv(tables / "comparisons.csv")
    pairs = set(zip(cmp["a"], cmp["b"]))
    assert {("cluster", "random"), ("oracle", "random"), ("cluster", "full"),
            ("cluster [balanced]", "cluster [random]")} <= pairs
    assert not {(a, b) for a, b in pairs if b in REFERENCES}  # the oracle is no contender
    assert (cmp["ci_low"] <= cmp["diff"]).all() and (cmp["diff"] <= cmp["ci_high"]).all()
    claims = (tables / "claims.md").read_text()
    for claim in ("accuracy kept at 31% of the data", "training time cut",
                  "better than usual selection", "power line (diagnosis)", "positive control",
                  "skill recovery (diagnosis)", "rare skills kept (diagnosis)"):
        assert claim in claims, claim
    # RS2 wrote one subset per training epoch; LESS and RDS+ read the validation split
    rs2 = pd.read_parquet(smoke_run / "results/select/skills/tiny/rs2-0.31/s0/selection.parquet")
    assert "epoch" in rs2 and rs2["epoch"].nunique() == 1  # the smoke trains 1 epoch
    for m in ("less", "rds"):
        js = json.loads((smoke_run / f"results/select/skills/tiny/{m}-0.31/s0/selection.json"
                         ).read_text())
        assert js["n_selected"] == round(0.31 * js["n_pool"])
    assert len(pd.read_parquet(smoke_run / "results/score/skills/tiny/s0/targets.parquet")) > 0
    items = pd.read_parquet(smoke_run / "results/eval/skills/tiny/cluster-0.31/g1-balanced/s0"
                            "/items.parquet")
    res = json.loads((smoke_run / EVAL).read_text())
    for task, t in res["tasks"].items():
        assert items[items["task"] == task]["value"].mean() == pytest.approx(t["value"])
    assert (smoke_run / "results" / "plots" / "skill_recovery.png").read_bytes()[:4] == b"\x89PNG"


def test_html_report(smoke_run: Path) -> None:
    snakemake(smoke_run, "--report", "results/report.html")
    html = (smoke_run / "results" / "report.html").read_text(errors="replace")
    assert "accuracy_vs_data" in html


def test_completed_run_reruns_nothing(smoke_run: Path) -> None:
    assert planned_rules(smoke_run) == {}


def test_changing_k_reruns_cluster_onward_not_score(smoke_run: Path, tmp_path: Path) -> None:
    cfg = yaml.safe_load(SMOKE.read_text())
    assert cfg["cluster"]["k"] != 3
    cfg["cluster"]["k"] = 3  # the user edits cluster.k in the config file
    edited = tmp_path / "config.yaml"
    edited.write_text(yaml.safe_dump(cfg))  # keys re-sorted too: key order must not matter
    plan = planned_rules(smoke_run, configfile=edited)
    assert plan.get("cluster") == 12  # one per dataset x model x seed x feature kind
    # one-rank accuracy runs: fused seed jobs (sweep.accuracy.fuse_seeds); time runs: train
    assert {"select", "train_seeds", "train", "evaluate_seeds", "report"} <= set(plan)
    assert not {"score", "prepare_data", "decontaminate", "contamination_table", "base_model", "tokenizer",
                "corpus", "evaluate_base"} & set(plan)


def test_a_model_train_override_reruns_train_onward_not_pretraining(smoke_run: Path, tmp_path: Path) -> None:
    cfg = yaml.safe_load(SMOKE.read_text())
    model = next(iter(cfg["models"]))
    cfg["models"][model]["train"] = {"lr": 1.0e-3}  # fine-tuning setting of one model
    edited = tmp_path / "config.yaml"
    edited.write_text(yaml.safe_dump(cfg))
    plan = planned_rules(smoke_run, configfile=edited)
    assert {"train_seeds", "train", "evaluate_seeds", "report"} <= set(plan)
    # pretraining and scoring do not depend on fine-tuning settings
    assert not {"base_model", "evaluate_base", "score", "cluster", "select"} & set(plan)


def test_fused_seeds_plan_one_job_per_run_for_all_seeds(smoke_run: Path, tmp_path: Path) -> None:
    """With two seeds, each one-rank accuracy run trains in one train_seeds job and
    evaluates in one evaluate_seeds job over both seeds (one process, `--seed 0 1`, logs
    and benchmarks at s0+1), and the report reads
    the fused jobs' benchmark files (a dry run fails on an input no rule makes)."""
    cfg = config_copy(tmp_path, "two", lambda c: c.update(seeds=[0, 1]))
    out = snakemake(smoke_run, "-n", "-p", configfile=cfg)
    text = out.stdout + out.stderr
    plan = planned_rules(smoke_run, configfile=cfg)
    # one job per run for both seeds: 4 methods on each of the 3 datasets, 6 baselines on
    # skills and the testbed, on the testbed the curve's 2 runs, the ablation's 1 and the
    # step-matched arm's 2
    assert plan["train_seeds"] == plan["evaluate_seeds"] == 3 * 4 + 2 * 6 + 2 + 1 + 2
    # the time runs (seed 0, 2 ranks: train jobs) are done; no one-seed job at one rank
    assert "train" not in plan and "evaluate" not in plan
    run = "skills/tiny/cluster-0.31/g1-balanced"
    assert (f"--selection results/select/skills/tiny/cluster-0.31/s0/selection.parquet "
            f"results/select/skills/tiny/cluster-0.31/s1/selection.parquet") in text
    assert "--seed 0 1 --threads 1" in text
    assert f"logs/train/{run}/s0+1.log" in text and f"logs/evaluate/{run}/s0+1.log" in text
    assert f"benchmarks/out/train/{run}/s0+1.tsv" in text


# ------------------------------------------------------------------------ determinism

SELECTIONS = [f"results/select/{d}/tiny/{m}/s{{seed}}/selection.parquet"
              for d in ("skills", "icd10") for m in ("full-1", "random-0.31", "cluster-0.31")]
EVAL = "results/eval/skills/tiny/cluster-0.31/g1-balanced/s0/results.json"


def config_copy(tmp_path: Path, name: str, edit) -> Path:
    cfg = yaml.safe_load(SMOKE.read_text())
    edit(cfg)
    out = tmp_path / f"{name}.yaml"
    out.write_text(yaml.safe_dump(cfg))
    return out


def eval_numbers(path: Path) -> dict:
    res = json.loads(path.read_text())
    return {"average": res["average"],
            **{t: (v["value"], v["stderr"], v["n"]) for t, v in res["tasks"].items()}}


def test_same_seed_same_selection_and_eval_other_seed_differs(smoke_run: Path, tmp_path: Path) -> None:
    """A second run from scratch (up to select, plus one train + evaluate) with the same seed
    gives byte-identical selections and the same evaluation numbers; seed 1 (a config copy
    with seeds: [1]) selects differently."""
    again = tmp_path / "again"
    again.mkdir()
    snakemake(again, *[s.format(seed=0) for s in SELECTIONS], EVAL)
    for s in SELECTIONS:
        a, b = (smoke_run / s.format(seed=0)), (again / s.format(seed=0))
        assert a.read_bytes() == b.read_bytes(), s
        summary = s.format(seed=0).replace(".parquet", ".json")
        assert (smoke_run / summary).read_bytes() == (again / summary).read_bytes(), summary
    assert eval_numbers(smoke_run / EVAL) == eval_numbers(again / EVAL)

    def seed1(c):
        c["seeds"] = [1]
        c["sweep"]["time"]["seeds"] = [1]

    other = config_copy(tmp_path, "seed1", seed1)
    targets = [s.format(seed=1) for s in SELECTIONS if "full-1" not in s]
    assert set(planned_rules(again, *targets, configfile=other)) == {"score", "cluster", "select"}
    snakemake(again, *targets, configfile=other)
    for s in targets:
        a = pd.read_parquet(again / s.replace("/s1/", "/s0/"))
        b = pd.read_parquet(again / s)
        assert len(a) == len(b) and set(a["id"]) != set(b["id"]), s


# --------------------------------------------------------------------- SIGKILL + resume

RUN = "results/train/skills/tiny/full-1/g2-balanced/s0"
TARGET = f"{RUN}/train_metrics.json"


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc), children first."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def upstream_mtimes(workdir: Path, keep: str = RUN) -> dict[str, int]:
    """mtime of every result file outside ``keep`` (the killed run's own folder)."""
    return {str(p.relative_to(workdir)): p.stat().st_mtime_ns
            for p in (workdir / "results").rglob("*") if p.is_file() and keep not in str(p)}


def final_state(workdir: Path) -> tuple[dict, dict]:
    """The run's final weights and metrics; a time-only run keeps no model (2 ranks: the
    sweep's time runs), so its weights are the digest NOT_KEPT.json records of them."""
    from safetensors.torch import load_file

    metrics = json.loads((workdir / TARGET).read_text())
    not_kept = workdir / RUN / "model" / "NOT_KEPT.json"
    if not_kept.exists():
        import torch

        digest = json.loads(not_kept.read_text())["weights_sha256"]
        return {"weights_sha256": torch.tensor(list(bytes.fromhex(digest)))}, metrics
    return load_file(str(workdir / RUN / "model" / "model.safetensors")), metrics


def snakemake_killed_when(work: Path, cfg: Path, target: str, ready, log_path: Path,
                          job: str) -> list[int]:
    """Start `snakemake target`, wait until ``ready()`` (at most 180 s), SIGKILL the whole
    workflow as a scheduler would (its process group and every job process below it, which
    sit in sessions of their own), and return the processes that outlived it."""
    import signal
    import time

    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    cmd = [sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "--directory", str(work),
           "--configfile", str(cfg), "--cores", "2", target]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            deadline = time.time() + 180
            while not ready() and proc.poll() is None and time.time() < deadline:
                time.sleep(0.02)
            assert ready() and proc.poll() is None, log_path.read_text()[-3000:]
            tree = descendants(proc.pid)
            assert any(job in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")
                       for p in tree if alive(p)), job
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            deadline = time.time() + 30
            while any(alive(p) for p in tree) and time.time() < deadline:
                time.sleep(0.1)
            return [p for p in tree if alive(p)]
        finally:
            for p in descendants(proc.pid) + ([proc.pid] if proc.poll() is None else []):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)


def rerun_only(work: Path, cfg: Path, target: str, rule: str, keep: str) -> None:
    """After a kill: unlock, rerun the target with --rerun-incomplete; only ``rule`` runs and
    no result outside ``keep`` is touched."""
    before = upstream_mtimes(work, keep)
    snakemake(work, "--unlock", configfile=cfg)
    rerun = snakemake(work, "--rerun-incomplete", target, configfile=cfg)
    ran = re.findall(r"Finished jobid: \d+ \(Rule: (\w+)\)", rerun.stdout + rerun.stderr)
    assert ran == [rule], ran  # no completed upstream rule ran again
    assert upstream_mtimes(work, keep) == before


def test_sigkill_mid_epoch_then_rerun_resumes_to_the_same_model(smoke_run: Path, tmp_path: Path) -> None:
    import shutil

    import torch

    work = tmp_path / "killed"
    shutil.copytree(smoke_run, work, symlinks=True)  # mtimes and .snakemake metadata kept
    cfg = config_copy(tmp_path, "ckpt", lambda c: c["train"].update(epochs=2, checkpoint_every=2))
    assert planned_rules(work, TARGET, configfile=cfg) == {"train": 1}  # train params changed
    before = upstream_mtimes(work)

    ckpt = work / (RUN + "/model.ckpt") / "state.pt"
    survivors = snakemake_killed_when(work, cfg, TARGET, ckpt.exists, tmp_path / "killed.log",
                                      "clusterft.stages.train")
    assert not survivors, "training ranks outlived the killed workflow"
    assert not (work / TARGET).exists()  # killed mid-epoch: no output looks complete
    step = torch.load(ckpt, weights_only=False)["step"]
    assert 2 <= step < 50, step

    rerun_only(work, cfg, TARGET, "train", RUN)
    assert upstream_mtimes(work) == before
    resumed_w, resumed = final_state(work)
    assert resumed["resumed_from_step"] is not None and resumed["resumed_from_step"] >= step
    assert not (work / (RUN + "/model.ckpt")).exists()  # removed once training completed

    snakemake(work, "--force", TARGET, configfile=cfg)  # uninterrupted, same seed
    full_w, full = final_state(work)
    assert full["resumed_from_step"] is None
    assert set(full_w) == set(resumed_w)
    assert all(torch.equal(full_w[k], resumed_w[k]) for k in full_w)
    for key in ("steps", "tokens", "loss_tokens", "padded_tokens", "examples", "epochs",
                "per_rank_tokens_per_step", "loss_curve", "final_loss", "epoch_losses"):
        assert resumed[key] == full[key], key
    assert full["steps"] == 50


BASE = "results/models/tiny/base"
FEATURES = "results/score/skills/tiny/s0/features.npy"


def test_sigkill_mid_pretraining_then_rerun_resumes_to_the_same_base_model(
        smoke_run: Path, tmp_path: Path) -> None:
    import shutil

    import torch
    from safetensors.torch import load_file

    work = tmp_path / "killed"
    shutil.copytree(smoke_run, work, symlinks=True)
    cfg = config_copy(tmp_path, "ckpt", lambda c: c["models"]["tiny"]["pretrain"].update(
        steps=300, checkpoint_every=10))
    assert planned_rules(work, BASE, configfile=cfg) == {"base_model": 1}
    ckpt = work / (BASE + ".ckpt") / "state.pt"
    assert not snakemake_killed_when(work, cfg, BASE, ckpt.exists, tmp_path / "killed.log",
                                     "base_model")
    assert not (work / BASE).exists()  # no half-written model folder
    step = torch.load(ckpt, weights_only=False)["step"]
    assert 10 <= step < 300, step

    rerun_only(work, cfg, BASE, "base_model", BASE)
    resumed = json.loads((work / BASE / "pretrain_metrics.json").read_text())
    assert resumed["resumed_from_step"] >= step
    assert not (work / (BASE + ".ckpt")).exists()
    resumed_w = load_file(str(work / BASE / "model.safetensors"))

    snakemake(work, "--force", BASE, configfile=cfg)  # uninterrupted
    full = json.loads((work / BASE / "pretrain_metrics.json").read_text())
    full_w = load_file(str(work / BASE / "model.safetensors"))
    assert full["resumed_from_step"] is None
    assert all(torch.equal(full_w[k], resumed_w[k]) for k in full_w)
    assert resumed["loss_curve"] == full["loss_curve"] and resumed["val_loss"] == full["val_loss"]


@pytest.mark.parametrize("point", ["after-warm-up", "mid-gradients"])
def test_sigkill_in_score_then_rerun_resumes_to_the_same_features(
        smoke_run: Path, tmp_path: Path, point: str) -> None:
    import shutil

    import numpy as np

    work = tmp_path / "killed"
    shutil.copytree(smoke_run, work, symlinks=True)
    cfg = config_copy(tmp_path, "ckpt", lambda c: c["score"].update(
        batch_size=2, checkpoint_every=1, warmup_steps=40))
    assert planned_rules(work, FEATURES, configfile=cfg) == {"score": 1}
    ckdir = work / (FEATURES + ".ckpt")
    ready = {"after-warm-up": lambda: (ckdir / "warmup.pt").exists(),
             "mid-gradients": lambda: (ckdir / "gradients.pt").exists()}[point]
    assert not snakemake_killed_when(work, cfg, FEATURES, ready, tmp_path / "killed.log", "score")
    assert not (work / FEATURES).exists()

    rerun_only(work, cfg, FEATURES, "score", "results/score/skills/tiny/s0")
    log = (work / "logs/score/skills/tiny/s0.log").read_text()
    assert "resuming from" in log and "warmup.pt" in log, log[-2000:]
    assert not ckdir.exists()
    resumed = np.load(work / FEATURES)
    scores = pd.read_parquet(work / FEATURES.replace("features.npy", "scores.parquet"))

    snakemake(work, "--force", FEATURES, configfile=cfg)  # uninterrupted
    assert np.array_equal(np.load(work / FEATURES), resumed)
    pd.testing.assert_frame_equal(
        pd.read_parquet(work / FEATURES.replace("features.npy", "scores.parquet")), scores)


def test_sigkill_mid_evaluation_then_rerun_gives_the_same_results(smoke_run: Path,
                                                                   tmp_path: Path) -> None:
    import shutil

    work = tmp_path / "killed"
    shutil.copytree(smoke_run, work, symlinks=True)
    target = EVAL
    out = work / target
    lm_eval_started = work / Path(target).parent / "tasks"
    snakemake(work, "--unlock")
    # as if never evaluated (every output of the job goes, so the task YAMLs appear only
    # once this evaluate job has started lm-eval); the rerun makes them again
    (work / target).unlink()
    (work / target).with_name("results.lm_eval.json").unlink()
    shutil.rmtree(lm_eval_started)
    assert planned_rules(work, target) == {"evaluate_seeds": 1}  # fuse_seeds: the run's job
    assert not snakemake_killed_when(
        work, SMOKE, target, lambda: any(lm_eval_started.glob("*.yaml")),
        tmp_path / "killed.log", "evaluate")
    assert not out.exists()
    rerun_only(work, SMOKE, target, "evaluate_seeds", str(Path(target).parent))
    assert eval_numbers(out) == eval_numbers(smoke_run / target)


# ----------------------------------------------------------------------- contamination

def test_workflow_stops_on_remaining_overlap_and_drop_cleans_it(tmp_path: Path) -> None:
    """A user's pool with a planted skills benchmark item: with decontaminate: flag the
    workflow stops before scoring, naming the pool, the task and the count; with drop the
    item is gone from pool.jsonl and counted in contamination.csv."""
    from clusterft.stages.data.prepare import run_prepare_data
    from clusterft.pipeline.io import write_jsonl

    smoke = yaml.safe_load(SMOKE.read_text())
    skills = {"items_per_task": smoke["tasks"]["items_per_task"], **smoke["datasets"]["skills"]}
    ref = tmp_path / "ref"
    run_prepare_data("skills", skills, ref / "pool.jsonl", ref / "labels.parquet", ref / "bench",
                     seed=smoke["data_seed"])
    item = json.loads((ref / "bench" / "skills_words.jsonl").read_text().splitlines()[3])
    user = item["prompt"].removeprefix("### Instruction:\n").removesuffix("\n\n### Response:\n")
    recs = [{"id": f"mine-{i}", "messages": [{"role": "user", "content": f"Say the number {i}."},
                                             {"role": "assistant", "content": f" {i}"}]}
            for i in range(6)]
    recs.insert(2, {"id": "planted", "messages": [{"role": "user", "content": user},
                                                  {"role": "assistant", "content": item["answer"]}]})
    write_jsonl(tmp_path / "mine.jsonl", recs)

    def mine(action):
        def edit(c):
            c["datasets"]["mine"] = {"domain": "programming", "source": "jsonl",
                                     "path": str(tmp_path / "mine.jsonl")}
            # a named lm-eval task (its data: the download rule's stand-in, HumanEval's
            # real problems), so the user's pool is checked against the skills items and it
            c["tasks"].update(decontaminate=action, lm_eval_tasks={"programming": ["humaneval"]})
            c["download"] = {"standins": True}
            # the oracle needs labels and less/rds validation items, which neither a plain
            # JSONL pool nor named lm-eval tasks give (the config check refuses them)
            for group in (c["sweep"], c["sweep"]["baselines"]):
                group["methods"] = [m for m in group["methods"]
                                    if m not in ("oracle", "less", "rds")]
            c["sweep"].pop("step_matched")  # the testbed's arm runs the oracle
        return edit

    work = tmp_path / "work"
    work.mkdir()
    target = "results/data/mine/pool.jsonl"
    out = snakemake(work, target, check=False, configfile=config_copy(tmp_path, "flag", mine("flag")))
    text = out.stdout + out.stderr
    assert out.returncode != 0 and not (work / target).exists()
    assert re.search(r"pool\.raw\.jsonl, line 3, field 'tasks\.max_overlap': pool 'mine' still "
                     r"has 1 examples overlapping benchmark task 'skills_words' .*record 'planted'", text), \
        text[-3000:]
    snakemake(work, target, "results/data/mine/contamination.csv",
              configfile=config_copy(tmp_path, "drop", mine("drop")))
    assert [json.loads(x)["id"] for x in (work / target).read_text().splitlines()] == \
        [r["id"] for r in recs if r["id"] != "planted"]
    table = pd.read_csv(work / "results/data/mine/contamination.csv").set_index("task")
    assert table.loc["skills_words", "dropped"] == 1 and table["remaining"].sum() == 0
    assert table.loc["skills_words", ["exact", "ngram", "similar"]].sum() == 1


# ----------------------------------------------------------------------- concurrent runs

def test_a_second_run_on_the_same_folder_is_refused_and_the_first_finishes(tmp_path: Path) -> None:
    """Snakemake's directory lock: while one run works in a folder, a second run there stops
    at once with a message saying why and what to do; the first run finishes unharmed."""
    work = tmp_path / "work"
    work.mkdir()
    # several jobs (data, corpus, tokenizer, pretraining): the first run is still working
    # when the second one starts
    target = "results/models/tiny/base"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    cmd = [sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "--directory",
           str(work), "--configfile", str(SMOKE), "--cores", "1", target]
    first = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        import time

        locks = work / ".snakemake" / "locks"
        deadline = time.monotonic() + 120
        while not (locks.is_dir() and any(locks.iterdir())):
            assert first.poll() is None, "the first run ended before it took the lock"
            assert time.monotonic() < deadline, "no lock after 120 s"
            time.sleep(0.2)
        second = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    finally:
        log, _ = first.communicate(timeout=600)
    text = second.stdout + second.stderr
    assert second.returncode != 0
    assert "cannot be locked" in text and "--unlock" in text, text[-2000:]
    assert first.returncode == 0, log[-3000:]
    assert json.loads((work / target / "pretrain_metrics.json").read_text())["steps"] > 0
    assert planned_rules(work, target) == {}  # complete: nothing left to redo


def test_selection_overhead_table_matches_the_benchmark_files(smoke_run: Path) -> None:
    """The report's selection-overhead table is the one clusterft.analysis.overhead computes from the
    run's own Snakemake benchmark files."""
    from clusterft.analysis.overhead import overhead_table, read_benchmarks

    t = overhead_table(read_benchmarks(smoke_run / "benchmarks" / "out"))
    csv = pd.read_csv(smoke_run / "results/tables/selection_overhead.csv")
    assert len(csv) == len(t) > 0
    assert csv["ratio"].tolist() == pytest.approx(t["ratio"].tolist())
    assert (csv["ratio"] > 0).all()


def test_balance_cost_table_pairs_the_smoke_time_runs(smoke_run: Path) -> None:
    """The report's balance_cost table holds one row per pair of multi-rank time runs that
    differ only in the distribution, its measured ratio the two train_metrics.json files'
    wall times and its plan work their per-step padded tokens."""
    import json

    from clusterft.analysis.balancecost import plan_work

    bt = pd.read_csv(smoke_run / "results/tables/balance_cost.csv")
    runs = sorted((smoke_run / "results/train").glob("*/*/*/g[2-9]*-random/s*/train_metrics.json"))
    assert len(bt) == len(runs) > 0
    for path in runs:
        ds, model, mb = path.parts[-6:-3]
        method, budget = mb.rsplit("-", 1)
        rnd = json.loads(path.read_text())
        bal = json.loads(Path(str(path).replace("-random/", "-balanced/")).read_text())
        row = bt[(bt["dataset"] == ds) & (bt["model"] == model) & (bt["method"] == method)
                 & (bt["budget"] == float(budget))].iloc[0]
        assert row["measured_ratio"] == pytest.approx(bal["wall_time_s"] / rnd["wall_time_s"])
        assert plan_work(bal["padded_tokens_per_step"]) > 0
        assert 0.5 < row["gpu_predicted_ratio"] < 1.5
    assert bt["fit_runs"].min() >= 3
    assert "slowest rank" in (smoke_run / "results/tables/balance_cost.md").read_text()


def test_quick_target_is_a_first_result_from_the_jobs_of_the_whole_run(tmp_path: Path) -> None:
    """`snakemake quick` from scratch at smoke size: one testbed cell (cipher on the tiny
    model) with full, random, oracle and the method at the claim budget, its claims and
    skill recovery in results/quick; and the whole run then reuses every job it ran (a
    sub-DAG of `all`, not a separate code path)."""
    from clusterft.pipeline.names import FEATURE_KINDS

    fresh = tmp_path / "fresh"
    fresh.mkdir()
    whole = planned_rules(fresh)
    quick = planned_rules(fresh, "quick")
    assert quick["train_seeds"] == 4 and quick["base_model"] == 1
    assert quick["train_seeds"] < whole["train_seeds"]
    snakemake(fresh, "quick")
    tables = fresh / "results" / "quick" / "tables"
    runs = pd.read_csv(tables / "runs.csv")
    assert set(zip(runs["dataset"], runs["model"])) == {("cipher", "tiny")}
    assert set(runs["method"]) == {"full", "random", "oracle", "cluster", "base"}
    claims = (tables / "claims.md").read_text()
    rows = [line for line in claims.splitlines() if line.startswith("| ")]
    assert any(r.startswith("| oracle vs random: positive control") and "| cipher | tiny |" in r
               for r in rows), rows
    assert any(r.startswith("| skill recovery") and "| cipher | tiny |" in r for r in rows)
    assert any(r.startswith("| better than usual selection | cipher | tiny |") for r in rows)
    sr = pd.read_csv(tables / "skill_recovery.csv")
    assert set(sr["dataset"]) == {"cipher"} and set(sr["features"]) == set(FEATURE_KINDS)
    assert (fresh / "results" / "quick" / "plots" / "skill_recovery.png").read_bytes()[:4] \
        == b"\x89PNG"
    assert not (fresh / "results" / "tables" / "claims.md").exists()  # the whole report is not made
    assert planned_rules(fresh, "quick") == {}
    after = planned_rules(fresh)
    for rule, n in quick.items():
        if rule not in ("quick", "quick_report"):
            assert after.get(rule, 0) == whole[rule] - n, rule


def test_rule_times_attributes_every_job_to_a_part_of_the_study(smoke_run: Path) -> None:
    """benchmarks/rule_times.py on the smoke run: every benchmark file gets a part, the
    parts' seconds add up to the rules', and each sweep group of the smoke config shows."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from rule_times import part_times, rule_times
    from clusterft.plan.config import settings

    cfg = settings(yaml.safe_load(SMOKE.read_text()))
    rules, parts = rule_times(smoke_run), part_times(smoke_run, cfg)
    assert parts["jobs"].sum() == rules["jobs"].sum()
    assert abs(parts["total_s"].sum() - rules["total_s"].sum()) < 0.5
    names = set(parts.index)
    for part in ("cipher/tiny: paper protocol", "cipher/tiny: step-matched arm",
                 "cipher/tiny: budget curve", "cipher/tiny: distribution ablation",
                 "skills/tiny: baselines and skill recovery (other feature kinds)",
                 "shared: data, corpus, tokenizer, report", "base model tiny"):
        assert part in names, (part, names)
    assert any(p.endswith(": time sweep") for p in names)
