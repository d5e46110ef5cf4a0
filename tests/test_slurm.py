"""The smoke workflow submitted to a real one-node SLURM on localhost through profiles/slurm.

tests/slurm/start_slurm.sh installs and starts SLURM (slurmctld, slurmd, munge); the run uses
the real profile plus tests/slurm/profile (partition and resources of the one-node test
cluster). SLURM's own record of every finished job is its job-completion log
(jobcomp/script, one line per job with its id, state, exit code, work dir and stdout path,
whose folder names the rule). Checked: every job of the run went through sbatch and
finished there; the results equal a local run's; a job that fails once (a non-zero exit on
its first attempt) is retried and the workflow completes; a train job killed by `scancel`
mid-run resumes from its checkpoint on the retry and ends with the weights of an
uninterrupted run.

Where SLURM cannot be started (not root, no apt, no Debian) the module is skipped with the
reason, except under CI=true, where that fails. Every wait is bounded (`timeout -s KILL`):
the executor plugin can wait forever on status polling.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / ".test" / "config.yaml"
START = ROOT / "tests" / "slurm" / "start_slurm.sh"
PROFILE = ROOT / "profiles" / "slurm"
TEST_PROFILE = ROOT / "tests" / "slurm" / "profile"
JOBCOMP = Path(os.environ.get("SLURM_JOBCOMP_LOG", "/var/log/slurm/jobcomp.log"))
# Bounds (seconds) for SLURM's start and for the smoke run through it (measured: see docs/slurm.md).
START_LIMIT = 900
RUN_LIMIT = int(os.environ.get("CLUSTERFT_SLURM_RUN_LIMIT", "2400"))
# The rule whose (single) job fails on its first attempt: its Python cannot start there
# (PYTHONHOME of a missing folder, through sbatch --export-file), so the job exits 1.
FAIL_ONCE = "tokenizer"

RUN = "results/train/skills/tiny/full-1/g2-balanced/s0"
TARGET = f"{RUN}/train_metrics.json"
# By default one path of the smoke goes through SLURM (one dataset: data, tokenizer,
# pretraining, score, cluster, select, a 1- and a 2-rank train, evaluate; every rule kind
# that needs a job script of its own), which keeps CI within its time budget;
# CLUSTERFT_SLURM_SMOKE=full sends all of it (131 jobs); see docs/slurm.md for the times.
PART = os.environ.get("CLUSTERFT_SLURM_SMOKE", "part") != "full"
PART_TARGETS = ["results/eval/skills/tiny/cluster-0.31/g1-balanced/s0/results.json", TARGET]


def _env() -> dict:
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}


def _cmd(work: Path, configfile: Path, *args: str, slurm: bool) -> list[str]:
    """The snakemake command; ``args`` (targets first) go before the options, as
    --configfile and --set-resources take every word that follows them."""
    cmd = [sys.executable, "-m", "snakemake", *args, "-s", str(ROOT / "Snakefile"),
           "--directory", str(work), "--configfile", str(configfile)]
    if slurm:
        return cmd + ["--profile", str(PROFILE), "--workflow-profile", str(TEST_PROFILE)]
    return cmd + ["--cores", "2"]


def _bounded(cmd: list[str], limit: int) -> list[str]:
    return ["timeout", "-s", "KILL", str(limit), *cmd]


def _cancel_jobs_of(work: Path) -> None:
    """scancel every SLURM job still queued or running in ``work`` (after a failed run)."""
    out = subprocess.run(["timeout", "-s", "KILL", "20", "squeue", "-h", "-o", "%i|%Z"],
                         capture_output=True, text=True)
    ids = [i for i, _, d in (line.partition("|") for line in out.stdout.splitlines())
           if d.strip() == str(work)]
    if ids:
        subprocess.run(["timeout", "-s", "KILL", "20", "scancel", *ids], capture_output=True)


def run_snakemake(work: Path, configfile: Path, *args: str, slurm: bool, log: Path,
                  limit: int = RUN_LIMIT) -> str:
    """Run snakemake (bounded by ``timeout -s KILL``), its output to ``log``; return the output.
    Fails with the log's tail where the run fails or hits the bound."""
    work.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as fh:
        proc = subprocess.run(_bounded(_cmd(work, configfile, *args, slurm=slurm), limit),
                              cwd=work, env=_env(), stdout=fh, stderr=subprocess.STDOUT)
    text = log.read_text()
    if proc.returncode != 0:
        if slurm:
            _cancel_jobs_of(work)
        killed = " (killed at the bound of %d s)" % limit if proc.returncode in (124, 137, -9) else ""
        raise AssertionError(f"snakemake failed with {proc.returncode}{killed}:\n{text[-6000:]}")
    return text


def jobcomp_records(work: Path, since: int = 0) -> list[dict]:
    """SLURM's job-completion records (from byte ``since`` of the log) of jobs run in ``work``,
    each with the rule read from its stdout path (logs/slurm/rule_<rule>/...)."""
    with open(JOBCOMP, "rb") as fh:
        fh.seek(since)
        lines = fh.read().decode(errors="replace").splitlines()
    out = []
    for line in lines:
        rec = dict(re.findall(r"(\w+)=(\S*)", line))
        if rec.get("WorkDir") != str(work):
            continue
        m = re.search(r"/logs/slurm/rule_(\w+)/", rec.get("StdOut", ""))
        rec["rule"] = m.group(1) if m else None
        rest = rec.get("StdOut", "").split(f"rule_{rec['rule']}/", 1)[-1].rsplit("/", 1)
        rec["wildcards"] = rest[0] if len(rest) == 2 else ""
        out.append(rec)
    return out


def planned(work: Path, configfile: Path, *targets: str) -> Counter:
    """Rule -> job count that a dry run would execute (Snakemake's job stats table)."""
    out = subprocess.run(_bounded(_cmd(work, configfile, *targets, "-n", slurm=False), 300),
                         cwd=work, env=_env(), capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    stats = (out.stdout + out.stderr).split("Job stats:", 1)[1]
    return Counter({m.group(1): int(m.group(2)) for m in
                    (re.match(r"^(\w+)\s+(\d+)\s*$", ln.strip()) for ln in stats.splitlines())
                    if m and m.group(1) != "total"})


@pytest.fixture(scope="module")
def slurm() -> None:
    """A one-node SLURM on localhost, started by tests/slurm/start_slurm.sh; skipped (failed
    under CI=true) where it cannot start. Outside CI the test installs no system packages:
    where SLURM is not installed it says how to install it."""
    ci = os.environ.get("CI") == "true"
    why = None
    if shutil.which("timeout") is None:
        why = "no `timeout` command to bound the waits"
    elif not ci and not (shutil.which("slurmctld") and shutil.which("sbatch")):
        why = (f"SLURM is not installed; `sudo bash {START.relative_to(ROOT)}` installs Debian's "
               "slurmctld/slurmd/slurm-client/munge and starts a one-node SLURM (.ci/run does)")
    else:
        proc = subprocess.run(["timeout", "-s", "KILL", str(START_LIMIT), "bash", str(START)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            why = f"{START.relative_to(ROOT)} failed ({proc.returncode}): " \
                  f"{(proc.stderr or proc.stdout).strip()[-1500:]}"
        elif not JOBCOMP.is_file():
            why = f"SLURM is up but its job-completion log {JOBCOMP} is missing"
    if why:
        if ci:
            pytest.fail(f"SLURM could not be started under CI=true: {why}")
        pytest.skip(f"SLURM could not be started: {why}")


@pytest.fixture(scope="module")
def local_smoke(request, tmp_path_factory) -> Path:
    """The smoke run's work folder from a local run: the suite's own when a session-scoped
    `smoke_run` fixture exists (tests/conftest.py), else one made here."""
    with contextlib.suppress(pytest.FixtureLookupError):
        if not PART:
            return request.getfixturevalue("smoke_run")
    work = tmp_path_factory.mktemp("local_smoke")
    run_snakemake(work, SMOKE, *(PART_TARGETS if PART else []), slurm=False,
                  log=work.parent / "local_smoke.log")
    return work


@pytest.fixture(scope="module")
def slurm_smoke(slurm, tmp_path_factory) -> dict:
    """The smoke config run through SLURM: work folder, snakemake's output, SLURM's records
    of the run's jobs, the planned job counts and the wall time."""
    work = tmp_path_factory.mktemp("slurm_smoke")
    targets = PART_TARGETS if PART else []
    plan = planned(work, SMOKE, *targets)
    fail_env = work.parent / "fail_once.env"
    fail_env.write_bytes(b"PYTHONHOME=/nonexistent-python-home\0")  # sbatch --export-file format
    since = JOBCOMP.stat().st_size
    t0 = time.monotonic()
    text = run_snakemake(
        work, SMOKE, *targets, "--set-resources",
        f"{FAIL_ONCE}:slurm_extra='--export-file={fail_env}' if attempt == 1 else ''",
        slurm=True, log=work.parent / "slurm_smoke.log")
    wall = time.monotonic() - t0
    deadline = time.monotonic() + 30  # slurmctld appends a job's record right after it ends
    while True:
        records = jobcomp_records(work, since)
        # every planned job but `all` (run by snakemake itself), plus the failed attempt
        if len(records) >= sum(n for r, n in plan.items() if r != "all") + 1 \
                or time.monotonic() > deadline:
            break
        time.sleep(1)
    print(f"\nsmoke through SLURM: {wall:.0f} s wall, {len(records)} SLURM jobs: "
          f"{dict(Counter(r['rule'] for r in records))}")
    (work.parent / "slurm_jobs.json").write_text(json.dumps(
        {"wall_s": wall, "jobs": [{k: r.get(k) for k in ("JobId", "rule", "wildcards", "JobState",
                                                           "ExitCode", "Start", "End")}
                                  for r in records]}, indent=1))
    return {"work": work, "log": text, "records": records, "plan": plan, "wall": wall}


def failed_logs(text: str, limit: int = 6000) -> str:
    """The failed jobs' logs as snakemake printed them (show-failed-logs), the rules' own
    log first: a retried job's rule log is overwritten by the retry, so this is where the
    cause of a failed attempt survives."""
    blocks = re.findall(r"^Logfile (logs/\S+):\n=+\n(.*?)^={80}$", text, re.M | re.S)
    return "\n".join(f"{name}:\n{body[-limit:]}" for name, body in blocks) \
        or "(snakemake printed no failed job's log)"


def test_every_job_of_the_run_went_through_sbatch(slurm_smoke: dict) -> None:
    """SLURM's own job record lists, rule by rule, exactly the jobs the run planned (each
    completed once; the fail-once rule has one failed attempt more); snakemake ran no job
    itself except the input-only target `all`; every SLURM job id snakemake reported is in
    SLURM's record."""
    recs, plan, text = slurm_smoke["records"], slurm_smoke["plan"], slurm_smoke["log"]
    assert plan["train"] > 0 and plan["train_seeds"] > 0 and plan["evaluate_seeds"] > 0
    assert plan["score"] > 0 and (PART or plan["evaluate_base"] > 0)  # part: no base eval
    completed = Counter(r["rule"] for r in recs if r["JobState"] == "COMPLETED")
    assert completed == plan - Counter({"all": plan["all"]}), (completed, plan)
    failed = [r for r in recs if r["JobState"] != "COMPLETED"]
    assert [r["rule"] for r in failed] == [FAIL_ONCE], (failed, failed_logs(text))
    assert {r["Name"] for r in recs} == set(re.findall(r"SLURM run ID: (\S+)", text))
    submitted = re.findall(r"has been submitted with SLURM jobid (\d+)", text)
    assert sorted(submitted) == sorted(r["JobId"] for r in recs)
    assert re.findall(r"^localrule (\w+):", text, re.M) == (["all"] if plan["all"] else [])
    # one SLURM log per job, kept for successful jobs too (profiles/slurm)
    logs = list((slurm_smoke["work"] / "logs" / "slurm").rglob("*.log"))
    assert len(logs) == len(recs)


def test_a_job_failing_once_is_retried_and_the_workflow_completes(slurm_smoke: dict) -> None:
    """The fail-once rule's first SLURM job exited 1 (its Python could not start), snakemake
    resubmitted it (profiles/slurm: retries: 1), the second job completed and so did the
    workflow (its final target exists)."""
    recs = [r for r in slurm_smoke["records"] if r["rule"] == FAIL_ONCE]
    assert [(r["JobState"], r["ExitCode"]) for r in recs] == [("FAILED", "1:0"), ("COMPLETED", "0:0")]
    assert int(recs[0]["JobId"]) < int(recs[1]["JobId"])
    first_log = slurm_smoke["work"] / "logs" / "slurm" / f"rule_{FAIL_ONCE}" / f"{recs[0]['JobId']}.log"
    assert "nonexistent-python-home" in first_log.read_text()
    assert "Trying to restart job" in slurm_smoke["log"]
    n = sum(slurm_smoke["plan"].values())
    assert f"{n} of {n} steps (100%) done" in slurm_smoke["log"]


# Files whose content is a wall time (or made from wall times): they differ between any two
# runs. Every other result file must be the same as the local run's. Provenance sidecars
# hold digests of their inputs, and a base model's folder digest covers its
# pretrain_metrics.json (wall seconds), so two runs with byte-identical weights record
# different digests downstream; the files those sidecars describe are compared themselves.
# claims.md and findings.md state the measured time ratios next to the accuracy verdicts
# (whose numbers are compared in accuracy_vs_data and comparisons).
WALL_TIME_FILES = re.compile(r"^(tables/(time|selection_overhead|balance_cost)\.(csv|md)|plots/time[^/]*\.png"
                             r"|tables/(claims|findings)\.md|report\.html|.*provenance\.json)$")


def test_results_equal_a_local_run(slurm_smoke: dict, local_smoke: Path) -> None:
    """tests/tools/same_outputs.py finds every result file of the SLURM run equal to the
    local run's (byte for byte, or once the work folder and wall times are normalised)."""
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "tools" / "same_outputs.py"),
                          str(local_smoke), str(slurm_smoke["work"])],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "only after: []" in out.stdout, out.stdout[-3000:]
    assert PART or "only before: []" in out.stdout, out.stdout[-3000:]
    different = [ln.split()[0] for ln in out.stdout.splitlines()
                 if ln.startswith("   ") and ln.rstrip().endswith("DIFFERENT")]
    assert [d for d in different if not WALL_TIME_FILES.match(d)] == [], out.stdout[-3000:]
    assert int(re.search(r"byte-identical (\d+)", out.stdout).group(1)) > (10 if PART else 100)


def processes_in(folder: Path) -> list[str]:
    """Command lines of the processes whose working directory is ``folder`` (jobs run there)."""
    out = []
    for p in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            if Path(os.readlink(p / "cwd")) == folder:
                out.append((p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
    return out


def _weights(work: Path) -> dict:
    """The run's final weights; a time-only run (the 2-rank ones) keeps no model, only the
    digest of its weights in NOT_KEPT.json, which then stands for them."""
    import torch
    from safetensors.torch import load_file

    not_kept = work / RUN / "model" / "NOT_KEPT.json"
    if not_kept.exists():
        digest = json.loads(not_kept.read_text())["weights_sha256"]
        return {"weights_sha256": torch.tensor(list(bytes.fromhex(digest)))}
    return load_file(str(work / RUN / "model" / "model.safetensors"))


def test_train_job_cancelled_by_slurm_resumes_from_its_checkpoint(slurm_smoke: dict, tmp_path: Path) -> None:
    """A copy of the SLURM run with checkpoints every 2 steps and 2 epochs: its train job
    (2 ranks) is cancelled with `scancel` once a checkpoint exists; SLURM records it
    CANCELLED, snakemake resubmits it (retries) and the second job resumes from the
    checkpoint, ending with the weights and metrics of an uninterrupted local run."""
    import torch

    work = tmp_path / "killed"
    shutil.copytree(slurm_smoke["work"], work, symlinks=True)
    shutil.rmtree(work / "logs" / "slurm")
    cfg = yaml.safe_load(SMOKE.read_text())
    cfg["train"].update(epochs=2, checkpoint_every=2)
    cfgfile = tmp_path / "ckpt.yaml"
    cfgfile.write_text(yaml.safe_dump(cfg))
    assert planned(work, cfgfile, TARGET) == {"train": 1}

    ckpt = work / (RUN + "/model.ckpt") / "state.pt"
    since = JOBCOMP.stat().st_size
    log = tmp_path / "killed.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(_bounded(_cmd(work, cfgfile, TARGET, slurm=True), 900),
                                cwd=work, env=_env(), stdout=fh, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while not ckpt.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ckpt.exists(), log.read_text()[-3000:]
        q = subprocess.run(["timeout", "-s", "KILL", "20", "squeue", "-h", "-t", "RUNNING",
                            "-o", "%i|%Z|%k"], capture_output=True, text=True)
        jobs = [ln.split("|")[0] for ln in q.stdout.splitlines()
                if ln.split("|")[1] == str(work) and ln.split("|")[2].startswith("rule_train")]
        assert len(jobs) == 1, q.stdout
        subprocess.run(["timeout", "-s", "KILL", "20", "scancel", jobs[0]], check=True)
        step = torch.load(ckpt, weights_only=False)["step"]
        rc = proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
        _cancel_jobs_of(work)
    assert rc == 0, log.read_text()[-6000:]
    assert 2 <= step < 50, step

    time.sleep(2)
    recs = [r for r in jobcomp_records(work, since) if r["rule"] == "train"]
    assert [r["JobState"] for r in recs] == ["CANCELLED", "COMPLETED"], recs
    assert recs[0]["JobId"] == jobs[0]
    assert not processes_in(work), "processes of the cancelled job outlived it"
    resumed = json.loads((work / TARGET).read_text())
    assert resumed["resumed_from_step"] is not None and resumed["resumed_from_step"] >= step
    assert not (work / (RUN + "/model.ckpt")).exists()
    resumed_w = _weights(work)

    # the same job uninterrupted, run locally
    run_snakemake(work, cfgfile, TARGET, "--force", slurm=False, log=tmp_path / "full.log", limit=900)
    full = json.loads((work / TARGET).read_text())
    full_w = _weights(work)
    assert full["resumed_from_step"] is None and full["steps"] == 50
    assert set(full_w) == set(resumed_w)
    assert all(torch.equal(full_w[k], resumed_w[k]) for k in full_w)
    for key in ("steps", "tokens", "loss_curve", "final_loss", "epoch_losses"):
        assert resumed[key] == full[key], key
