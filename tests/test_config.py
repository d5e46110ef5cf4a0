"""Config: schema + checks reject bad configs naming the field; generated docs in sync;
the paper DAG builds offline; lint and format are clean."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from clusterft.tools import configdoc
from clusterft.plan.config import check_config, load_config, validate_schema
from clusterft.pipeline.errors import InputError

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ["config/config.yaml", "config/paper.yaml", ".test/config.yaml"]


def base() -> dict:
    return yaml.safe_load((ROOT / "config" / "config.yaml").read_text())


@pytest.mark.parametrize("path", CONFIGS)
def test_shipped_configs_are_valid(path: str) -> None:
    cfg = load_config(ROOT / path)
    assert cfg["datasets"] and cfg["models"]


def test_generated_readme_is_up_to_date() -> None:
    assert configdoc.README_PATH.read_text() == configdoc.build_readme(), \
        "run: python -m clusterft.tools.configdoc"


def test_every_stage_key_is_documented() -> None:
    readme = configdoc.README_PATH.read_text()
    from clusterft.stages import score
    from clusterft.stages import train

    for key in list(score.DEFAULTS) + list(train.DEFAULTS):
        assert f"| `{key}`" in readme or f"| `{key}." in readme, key
    rows = [r for r in readme.splitlines() if r.startswith("| `")]
    undocumented = [r for r in rows if r.rstrip().endswith("|  |")]
    assert len(undocumented) <= len(rows) // 10, undocumented


def _edit(fn):
    cfg = base()
    fn(cfg)
    return cfg


BAD = [
    ("unknown top-level key", lambda c: c.update(colour="red"), "colour"),
    ("unknown stage key", lambda c: c["score"].update(dims=3), "dims"),
    ("budget above 1", lambda c: c["sweep"].update(budgets=[0.31, 1.5]), "sweep.budgets.1"),
    ("budget zero", lambda c: c["sweep"].update(budgets=[0]), "sweep.budgets.0"),
    ("gpus zero", lambda c: c["sweep"]["accuracy"].update(gpus=0), "sweep.accuracy.gpus"),
    ("negative gpus", lambda c: c["sweep"]["time"].update(gpus=[2, -4]), "sweep.time.gpus.1"),
    ("unknown method", lambda c: c["sweep"].update(methods=["full", "kmeans"]), "sweep.methods.1"),
    ("unknown distribution", lambda c: c["sweep"]["accuracy"].update(distribution="roundrobin"),
     "sweep.accuracy.distribution"),
    ("unknown data source", lambda c: c["datasets"]["pycode"].update(source="csv"),
     "datasets.pycode.source"),
    ("stage key of the wrong type", lambda c: c["train"].update(epochs="three"), "train.epochs"),
    ("nested stage key", lambda c: c["score"].update(lora={"rank": 4}), "score.lora.rank"),
    ("unknown key of a model's train override",
     lambda c: c["models"]["small"].update(train={"epoch": 2}), "models.small.train.epoch"),
    ("unknown key of a model's pretrain",
     lambda c: c["models"]["small"].update(pretrain={"stepz": 2}), "models.small.pretrain.stepz"),
    ("unknown key of a dataset's train override",
     lambda c: c["datasets"]["pycode"].update(train={"finetune": "full"}),
     "datasets.pycode.train.finetune"),
    ("dataset train key of the wrong type",
     lambda c: c["datasets"]["pycode"].update(train={"epochs": "a"}),
     "datasets.pycode.train.epochs"),
    ("dataset train epochs zero",
     lambda c: c["datasets"]["pycode"].update(train={"epochs": 0}), "datasets.pycode.train.epochs"),
    ("dataset key its source has no use for",
     lambda c: c["datasets"]["pycode"].update(hf_dataset="x"), "datasets.pycode.hf_dataset"),
    ("unknown tokenizer key", lambda c: c["tokenizer"].update(vocab=12), "tokenizer.vocab"),
    ("a max_length word other than auto", lambda c: c["train"].update(max_length="longest"),
     "train.max_length"),
    ("a model's max_length word", lambda c: c["models"]["small"].update(
        train={"max_length": "Auto"}), "models.small.train.max_length"),
    ("max_length quantile above 1", lambda c: c["score"].update(max_length_quantile=1.5),
     "score.max_length_quantile"),
    ("max_length cap below 4", lambda c: c.setdefault("features", {}).update(max_length_cap=2),
     "features.max_length_cap"),
    ("resources.runtime_safety zero", lambda c: c.update(resources={"runtime_safety": 0}),
     "resources.runtime_safety"),
    ("unknown practice key", lambda c: c["models"]["small"]["practice"].update(epochs=3),
     "models.small.practice.epochs"),
    ("practice steps a word", lambda c: c["models"]["small"]["practice"].update(steps="many"),
     "models.small.practice.steps"),
]


def test_max_length_auto_is_accepted_where_the_stages_measure_it() -> None:
    """score, features and train (and a model's train override) take max_length: auto;
    another word is refused naming the field and the two forms it may take."""
    cfg = _edit(lambda c: (c["score"].update(max_length="auto", max_length_quantile=0.95),
                           c.setdefault("features", {}).update(max_length="auto"),
                           c["train"].update(max_length="auto", max_length_cap=512),
                           c["models"]["small"].update(train={"max_length": "auto"})))
    validate_schema(cfg, source="my.yaml")
    check_config(cfg, source="my.yaml")
    with pytest.raises(InputError, match=r"score\.max_length.*an integer or 'auto', got 'max'"):
        validate_schema(_edit(lambda c: c["score"].update(max_length="max")), source="my.yaml")


@pytest.mark.parametrize("name,edit,field", BAD, ids=[b[0] for b in BAD])
def test_schema_rejects_bad_config_naming_the_field(name, edit, field) -> None:
    with pytest.raises(InputError) as e:
        validate_schema(_edit(edit), source="my.yaml")
    msg = str(e.value)
    assert "my.yaml" in msg and field in msg


def test_k_larger_than_pool_is_rejected() -> None:
    cfg = _edit(lambda c: c["cluster"].update(k=5000))
    with pytest.raises(InputError, match=r"datasets\.\w+\.n.*cluster\.k = 5000"):
        check_config(cfg, source="my.yaml")


def _paper() -> dict:
    return yaml.safe_load((ROOT / "config" / "paper.yaml").read_text())


@pytest.mark.parametrize("method, group, field", [
    ("oracle", "methods", r"sweep\.methods\[3\].*'codealpaca' has none"),
])
def test_methods_whose_inputs_the_config_lacks_are_refused(method, group, field) -> None:
    """The paper config's hub pools have no labels: the oracle is refused before any
    job."""
    cfg = _paper()
    check_config(cfg)  # as shipped: accepted
    if group == "methods":
        cfg["sweep"]["methods"].append(method)
    else:
        cfg["sweep"]["baselines"]["methods"].append(method)
    with pytest.raises(InputError, match=field):
        check_config(cfg, source="paper.yaml")


@pytest.mark.parametrize("method", ["less", "rds"])
def test_target_aware_baselines_take_the_named_tasks_dev_splits(method) -> None:
    """LESS and RDS+ with the paper's lm-eval tasks: admitted where some task of each
    dataset's domain has a dev split (humaneval has none, mbpp and the MMLU subject do);
    refused, naming the tasks and why, where a domain's tasks have none."""
    cfg = _paper()
    cfg["sweep"]["baselines"]["methods"].append(method)
    check_config(cfg, source="paper.yaml")
    cfg["tasks"]["lm_eval_tasks"]["programming"] = ["humaneval"]
    with pytest.raises(InputError, match=r"sweep\.baselines\.methods\[4\].*no lm-eval task of "
                       r"domain 'programming' has a dev split.*humaneval: openai_humaneval "
                       r"has only its test split"):
        check_config(cfg, source="paper.yaml")


def test_a_labelled_hub_pool_admits_the_oracle() -> None:
    cfg = _paper()
    cfg["sweep"]["methods"].append("oracle")
    for spec in cfg["datasets"].values():
        spec["columns"] = {**spec["columns"], "label": "category"}
    check_config(cfg)
    first = next(iter(cfg["datasets"].values()))
    first["columns"].pop("label")
    with pytest.raises(InputError, match="oracle"):
        check_config(cfg)


def test_missing_model_path_is_rejected(tmp_path: Path) -> None:
    cfg = _edit(lambda c: c["models"].update(mine={"source": "path", "path": str(tmp_path / "nope")}))
    with pytest.raises(InputError, match=r"models\.mine\.path.*does not exist"):
        check_config(cfg)


def test_undefined_benchmark_task_is_rejected() -> None:
    cfg = _edit(lambda c: c["tasks"].update(only=["skills_mc", "mmlu_nope"]))
    with pytest.raises(InputError, match=r"tasks\.only\[1\].*mmlu_nope"):
        check_config(cfg)


def test_missing_dataset_file_is_rejected(tmp_path: Path) -> None:
    cfg = _edit(lambda c: c["datasets"].update(
        mine={"domain": "programming", "source": "jsonl", "path": str(tmp_path / "x.jsonl")}))
    with pytest.raises(InputError, match=r"datasets\.mine\.path.*does not exist"):
        check_config(cfg)


def test_undefined_time_sweep_model_is_rejected() -> None:
    cfg = _edit(lambda c: c["sweep"]["time"].update(models=["small", "medium"]))
    with pytest.raises(InputError, match=r"sweep\.time\.models\[1\].*'medium' is not defined"):
        check_config(cfg)


def test_time_sweep_models_restrict_the_time_runs(tmp_path: Path) -> None:
    cfg = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    cfg["sweep"]["time"]["models"] = ["small"]
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    out = _snakemake("-n", "--directory", str(tmp_path), "--configfile", str(tmp_path / "c.yaml"),
                     cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout + out.stderr
    assert "results/train/pycode/small/full-1/g4-random/s0" in text
    assert "results/train/pycode/large/full-1/g4-random/s0" not in text
    assert "results/train/pycode/large/full-1/g1-balanced/s0" in text  # accuracy runs stay


def test_global_batch_size_must_divide_every_gpu_count() -> None:
    cfg = _edit(lambda c: c["train"].update(global_batch_size=30))  # time gpus [2, 4]
    with pytest.raises(InputError, match=r"train\.global_batch_size.*sweep\.time\.gpus\[1\] = 4"):
        check_config(cfg)
    cfg = _edit(lambda c: c["models"]["large"].update(train={"global_batch_size": 6}))
    with pytest.raises(InputError, match=r"models\.large\.train\.global_batch_size"):
        check_config(cfg)


def test_a_model_train_section_overrides_the_train_section(tmp_path: Path) -> None:
    cfg = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    cfg["train"]["epochs"] = 3
    cfg["models"]["large"]["train"] = {"epochs": 2}
    cfg["models"]["small"].pop("train", None)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    out = _snakemake("results/train/pycode/large/full-1/g1-balanced/s0/model",
                     "results/train/pycode/small/full-1/g1-balanced/s0/model", "-n", "-p",
                     "--directory", str(tmp_path), "--configfile", str(tmp_path / "c.yaml"),
                     cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    cmds = [ln for ln in out.stdout.splitlines() if "clusterft.stages.train" in ln]
    large = next(c for c in cmds if "models/large/base" in c)
    small = next(c for c in cmds if "models/small/base" in c)
    assert '"epochs": 2' in large and '"epochs": 3' in small
    assert '"lr": ' + str(cfg["train"]["lr"]) in large  # the rest of train still applies
    cfg["models"]["large"]["train"] = {"epochz": 2}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    out = _snakemake("-n", "--directory", str(tmp_path), "--configfile", str(tmp_path / "c.yaml"),
                     cwd=tmp_path)
    assert out.returncode != 0 and "models.large.train.epochz" in out.stdout + out.stderr


def test_a_dataset_train_section_takes_epochs_and_lr_only() -> None:
    """datasets.<name>.train is accepted with epochs and lr (also as --config text, typed
    by the schema); the stage-section check alone (check_sections, behind the schema) names
    an unknown key and a value of the wrong type too."""
    from clusterft.plan.config import check_sections, coerce_overrides, prepare, run_train

    cfg = _edit(lambda c: c["datasets"]["pycode"].update(train={"epochs": 20, "lr": 1.0e-4}))
    validate_schema(cfg, source="my.yaml")
    check_config(cfg, source="my.yaml")
    settled = prepare(copy.deepcopy(cfg), warn=lambda m: None)
    for model in settled["models"]:
        t = run_train(settled, "pycode", model)
        assert (t["epochs"], t["lr"]) == (20, 1.0e-4)
        assert t["batch_size"] == settled["model_train"][model]["batch_size"]
    overrides = {"datasets": {"pycode": {"train": {"epochs": "7"}}}}
    cfg["datasets"]["pycode"]["train"] = {"epochs": "7"}
    coerce_overrides(cfg, overrides)
    assert cfg["datasets"]["pycode"]["train"]["epochs"] == 7
    for train, field, what in (({"finetune": "full"}, "datasets.pycode.train.finetune",
                                "unknown key 'finetune'; allowed here: epochs, lr"),
                               ({"epochs": "a"}, "datasets.pycode.train.epochs",
                                "must be an integer, got 'a'")):
        with pytest.raises(InputError) as e:
            check_sections(_edit(lambda c: c["datasets"]["pycode"].update(train=train)))
        assert e.value.field == field and what in str(e.value)
    with pytest.raises(InputError) as e:
        validate_schema(_edit(lambda c: c["datasets"]["pycode"].update(
            train={"finetune": "full"})), source="my.yaml")
    assert "datasets.pycode.train.finetune" in str(e.value) and "epochs, lr" in str(e.value)


def test_one_gpu_runs_start_without_torchrun(tmp_path: Path) -> None:
    """A one-rank run is a plain `python -m clusterft.stages.train` job; more ranks go through
    torchrun with one process per GPU."""
    out = _snakemake("results/train/pycode/small/full-1/g1-balanced/s0/model",
                     "results/train/pycode/small/full-1/g4-random/s0/model", "-n", "-p",
                     "--cores", "2", "--directory", str(tmp_path),
                     "--configfile", str(ROOT / "config" / "config.yaml"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    cmds = [ln.strip().removeprefix("Shell command: ") for ln in out.stdout.splitlines()
            if "-m clusterft.stages.train" in ln]
    one = next(c for c in cmds if "/g1-balanced/" in c)
    four = next(c for c in cmds if "/g4-random/" in c)
    assert one.startswith("python -m clusterft.stages.train ") and "torchrun" not in one
    assert four.startswith("torchrun --standalone --nnodes 1 --nproc-per-node 4 -m clusterft.stages.train ")
    assert "--threads 1 " in one and "--threads 2 " in four  # --threads is capped at --cores 2
    # sweep.time.epochs: 1 applies to the time-only run, not to the accuracy run
    cfg = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    assert cfg["sweep"]["time"]["epochs"] == 1 != cfg["train"]["epochs"]
    assert f'"epochs": {cfg["train"]["epochs"]}' in one and '"epochs": 1,' in four


def test_time_epochs_may_not_retrain_accuracy_runs() -> None:
    """sweep.time.epochs with a time run at the accuracy runs' GPU count and distribution
    would give one trained model two recipes: the config check names the key."""
    def overlap(c):
        c["sweep"]["time"].update(epochs=1, gpus=[1, 2])
        c["sweep"]["accuracy"].update(gpus=1, distribution="random")

    with pytest.raises(InputError, match=r"sweep\.time\.epochs.*1 GPU random"):
        check_config(_edit(overlap))
    check_config(_edit(lambda c: c["sweep"]["time"].update(epochs=1, gpus=[2, 4])))
    check_config(_edit(lambda c: (overlap(c), c["sweep"]["time"].update(epochs=None))))


def test_fused_seeds_need_one_gpu_accuracy_runs() -> None:
    """sweep.accuracy.fuse_seeds runs the seeds in one plain python process: on 2 or more
    GPUs (torchrun's ranks) the config check names the key; the embedded default fuses,
    the paper config does not."""
    with pytest.raises(InputError, match=r"sweep\.accuracy\.fuse_seeds.*gpus: 1 \(it is 8\)"):
        check_config(_edit(lambda c: c["sweep"]["accuracy"].update(gpus=8, fuse_seeds=True)))
    check_config(_edit(lambda c: c["sweep"]["accuracy"].update(gpus=8, fuse_seeds=False)))
    default = load_config(ROOT / "config" / "config.yaml")
    paper = load_config(ROOT / "config" / "paper.yaml")
    assert default["sweep"]["accuracy"]["fuse_seeds"] is True
    assert paper["sweep"]["accuracy"]["fuse_seeds"] is False


def _snakemake(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run([sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), *args],
                          capture_output=True, text=True, cwd=cwd, env=env, timeout=600)


def test_paper_dag_builds_offline(tmp_path: Path) -> None:
    out = _snakemake("-n", "--directory", str(tmp_path), "--configfile",
                     str(ROOT / "config" / "paper.yaml"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout + out.stderr
    for rule in ("prepare_data", "score", "cluster", "select", "train", "evaluate", "report"):
        assert f"rule {rule}:" in text or f"\n{rule} " in text
    assert "g8-balanced" in text and "g4-random" in text


def test_invalid_config_fails_before_any_job(tmp_path: Path) -> None:
    bad = base()
    bad["sweep"]["budgets"] = [0.31, 2]
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    out = _snakemake("-n", "--directory", str(tmp_path), "--configfile", str(tmp_path / "bad.yaml"),
                     cwd=tmp_path)
    assert out.returncode != 0
    assert "budgets" in out.stdout + out.stderr


def test_lint_and_format_are_clean() -> None:
    lint = _snakemake("--lint")
    assert lint.returncode == 0, lint.stdout[-3000:] + lint.stderr[-3000:]
    fmt = subprocess.run([str(Path(sys.executable).parent / "snakefmt"), "--check", str(ROOT)],
                         capture_output=True, text=True)
    assert fmt.returncode == 0, fmt.stderr[-2000:]


def test_every_rule_has_log_benchmark_conda_and_resources() -> None:
    """Catalog convention: every rule (but `all`) declares log, benchmark, conda, threads
    and resources."""
    import re

    for smk in sorted((ROOT / "workflow" / "rules").glob("*.smk")):
        text = smk.read_text()
        blocks = re.split(r"^(?=rule \w+:)", text, flags=re.M)
        for block in blocks:
            m = re.match(r"rule (\w+):", block)
            if not m or m.group(1) == "all":
                continue
            for key in ("log:", "benchmark:", "conda:", "threads:", "resources:"):
                assert f"\n    {key}" in block, f"{smk.name}: rule {m.group(1)} has no {key}"


def test_nested_config_overrides_are_typed_by_the_schema() -> None:
    """Snakemake hands nested --config values over as text: each becomes the type the
    schema (or the stage's DEFAULTS) wants where it reads as one; the rest stay text."""
    from clusterft.plan.config import coerce_overrides

    overrides = {"score": {"shards": "3", "device": "cpu"},
                 "sweep": {"budgets": ["0.25", "0.5"], "accuracy": {"fuse_seeds": "false"},
                           "time": {"epochs": "null"}},
                 "train": {"global_batch_size": "16", "lr": "1e-4"},
                 "datasets": {"pycode": {"n": "300"}}}
    cfg = base()
    for key, value in overrides.items():  # what Snakemake's update_config does
        for k, v in value.items():
            if isinstance(v, dict) and isinstance(cfg[key].get(k), dict):
                cfg[key][k].update(v)
            else:
                cfg[key][k] = v
    coerce_overrides(cfg, overrides)
    assert cfg["score"]["shards"] == 3 and cfg["score"]["device"] == "cpu"
    assert cfg["sweep"]["budgets"] == [0.25, 0.5]
    assert cfg["sweep"]["accuracy"]["fuse_seeds"] is False
    assert cfg["sweep"]["time"]["epochs"] is None
    assert cfg["train"]["global_batch_size"] == 16 and cfg["train"]["lr"] == 1e-4
    assert cfg["datasets"]["pycode"]["n"] == 300
    validate_schema(cfg)


def test_a_bad_override_names_config_not_a_file_line() -> None:
    from clusterft.plan.config import prepare

    cfg = base()
    cfg["score"]["shards"] = "three"
    with pytest.raises(InputError) as e:
        prepare(cfg, str(ROOT / "config" / "config.yaml"),
                overrides={"score": {"shards": "three"}}, warn=lambda m: None)
    msg = str(e.value)
    assert msg.startswith("--config, field 'score.shards': must be an integer, got 'three'")
    assert "line" not in msg.split(":")[0] and """--config 'score={"shards": 3}'""" in msg
    # the same value written in the file: the file's line, as before
    with pytest.raises(InputError, match=r"config\.yaml, line \d+, field 'score\.shards'"):
        prepare(base() | {"score": {"shards": "three"}}, str(ROOT / "config" / "config.yaml"),
                warn=lambda m: None)


def test_the_decontaminate_defaults_are_the_stage_s() -> None:
    """Written once, in the stage module: the schema gets them from there."""
    from clusterft.plan.config import SCHEMA, schema
    from clusterft.stages.data import decontaminate

    tasks = schema()["properties"]["tasks"]["properties"]
    assert tasks["decontaminate"]["default"] == decontaminate.DEFAULTS["action"]
    assert tasks["max_overlap"]["default"] == decontaminate.DEFAULTS["max_overlap"]
    raw = yaml.safe_load(SCHEMA.read_text())["properties"]["tasks"]["properties"]
    assert "default" not in raw["decontaminate"] and "default" not in raw["max_overlap"]


def test_nested_config_override_in_a_dry_run(tmp_path: Path) -> None:
    """`--config 'score={"shards": 3}'` plans three score_shard jobs per score run; a value
    that is no integer stops the dry run naming --config and how to write it."""
    args = ("-n", "-F", "--quiet", "rules", "--directory", str(tmp_path),
            "--configfile", str(ROOT / ".test" / "config.yaml"))
    out = _snakemake(*args, "--config", 'score={"shards": 3}', cwd=tmp_path)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    counts = {}
    for line in (out.stdout + out.stderr).split("Job stats:")[-1].splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            counts[parts[0]] = int(parts[1])
    assert counts["score_shard"] == 3 * counts["score"] == 3 * counts["score_warmup"] > 0
    out = _snakemake(*args, "--config", 'score={"shards": "3x"}', cwd=tmp_path)
    text = out.stdout + out.stderr
    assert out.returncode != 0
    assert "--config, field 'score.shards': must be an integer, got '3x'" in text
    assert """--config 'score={"shards": 3}'""" in text and "config.yaml, line" not in text


@pytest.mark.parametrize("edit,field,words", [
    (lambda c: c["models"]["small"]["practice"].update(n_words=16), "datasets.cipher.n_words",
     "practised ciphers over 16"),
    (lambda c: c["datasets"]["cipher"].update(n_skills=9), "datasets.cipher.n_skills",
     "reuse a practice key"),
    (lambda c: c["models"]["small"]["practice"].update(n=20000), "models.small.practice.n",
     "distinct inputs"),
    (lambda c: c["models"]["small"]["practice"].update(attempts=0),
     "models.small.practice.attempts", "integer >= 1"),
    (lambda c: c["models"]["small"]["practice"].update(min_exact=95),
     "models.small.practice.min_exact", "[0, 1]"),
])
def test_a_practised_model_and_its_testbed_must_agree(edit, field, words) -> None:
    """models.<name>.practice teaches the lookup over the testbed's words with other keys:
    a testbed on another vocabulary, one that would reuse a practice key, or a practice pool
    the generator cannot make is refused before any work, naming the field."""
    check_config(base(), source="my.yaml")
    with pytest.raises(InputError) as e:
        check_config(_edit(edit), source="my.yaml")
    assert field in str(e.value) and words in str(e.value) and "my.yaml" in str(e.value)
    # without practice (steps 0) the same testbed is free to use other words
    cfg = _edit(lambda c: (c["models"]["small"]["practice"].update(steps=0),
                           c["datasets"]["cipher"].update(n_words=16)))
    check_config(cfg, source="my.yaml")
