"""Evaluate a trained model on the benchmark tasks with lm-eval (the `hf` model, offline).

`write_task_yamls` turns benchmark item files into lm-eval task YAMLs (templates in
`workflow/tasks/`, absolute data paths); `run_evaluate` runs every task of one model in a
single `lm_eval.simple_evaluate` call and writes `results.json` in the design format
(`{"tasks": {name: {metric, value, stderr, n}}, "average"}`) plus lm-eval's raw results
beside it (`<stem>.lm_eval.json`).

Sharding (`evaluate.shards`, for many tasks on a cluster): `shard_tasks` deals a run's tasks
round-robin into jobs, each a `run_evaluate` over its tasks; `merge_shards` joins them into
the outputs one job writes. Equal because lm-eval scores each task on its own: its items,
seeds and metrics do not depend on the other tasks of the call (tests/test_evaluate_shards.py).

BOS: lm-eval's `hf` model with `add_bos_token` unset calls the tokenizer with its default
`add_special_tokens=True`, so our tokenizer's post-processor prepends exactly one `<s>` to
each context (and to the context+continuation pair, which lm-eval splits after the
context's tokens); prompts never start with the `<s>` string, so lm-eval's "already has a
BOS" shortcut never fires. Passing `add_bos_token=True` would not double it either (it only
sets `add_special_tokens`). tests/test_evaluate.py checks the token ids.

Context length: lm-eval reads `max_position_embeddings` from the model config; contexts
longer than that (minus `max_gen_toks` for generation) are cut from the LEFT, losing the
instruction. `run_evaluate` counts the prompts that do not fit and logs a warning.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import yaml

from clusterft.pipeline.sections import merge_section
from clusterft.modeling import cpu_matmul
from clusterft.modeling.distributed import resolve_device
from clusterft.pipeline.errors import InputError
from clusterft.pipeline import provenance
from clusterft.modeling.hf import adapter_base, check_weights
from clusterft.pipeline.io import BOM, read_jsonl, set_offline_env, write_json, write_jsonl, write_text

log = logging.getLogger(__name__)

DEFAULTS: dict[str, Any] = {
    # Sequences per forward pass in lm-eval (log-likelihood and generation batches).
    "batch_size": 32,
    # Largest number of new tokens per generation item (the repo-defined tasks).
    "max_gen_toks": 32,
    # lm-eval's built-in generation tasks (humaneval, mbpp) keep their own task's limit
    # (humaneval: 1024) unless this caps it (lm-eval's gen_kwargs); config/rehearsal.yaml
    # caps it on CPU, config/paper.yaml keeps the tasks' own.
    "builtin_max_gen_toks": None,
    # Generation stops at the first of these strings (lm-eval adds the EOS string too).
    "stop_sequences": ["\n", "</s>", "###"],
    # Items per task (int) or fraction (float < 1); null evaluates every item. For tests.
    "limit": None,
    # "auto" (cuda:0 when available, else cpu), "cpu" or a torch device string.
    "device": "auto",
    # Model weights dtype passed to lm-eval's hf model: float32, bfloat16, float16 or auto
    # (the dtype in the model's config).
    "dtype": "float32",
    # Split the model over the job's GPUs (lm-eval hf model arg `parallelize`, accelerate's
    # device_map "auto"): for models that do not fit on one GPU. Needs a GPU device.
    "parallelize": False,
    # GPUs one evaluate job requests (the rule's `gpu` resource on a GPU cluster); more than
    # 1 needs parallelize: true, else the extra GPUs would sit idle.
    "gpus": 1,
    # Evaluate each run's tasks in this many jobs (tasks dealt round-robin, at most one job
    # per task), merged into the same results.json, results.lm_eval.json, items.parquet and
    # tasks/ as one job writes; 1 is one job per run.
    "shards": 1,
    # Context length in tokens for lm-eval; null uses the model's max_position_embeddings.
    "max_length": None,
    # Torch CPU threads for the evaluation; null leaves torch's default.
    "num_threads": None,
    # Resamples for bootstrap standard errors (acc and exact_match use the closed form).
    "bootstrap_iters": 1000,
    # Allow tasks marked unsafe_code (they execute model-written code); off by default.
    "confirm_run_unsafe_code": False,
    # Let lm-eval record torch's collect_env report in the raw results (runs `pip list` and
    # more in subprocesses: seconds per evaluation); off records versions only.
    "collect_env_info": False,
    # Folder of task YAML templates; null uses workflow/tasks/ beside the package.
    "templates_dir": None,
    # Allow lm-eval's built-in tasks by name (config/paper.yaml; they download their data).
    "allow_builtin_tasks": False,
    # Allow HF hub downloads (normally false: everything runs offline).
    "allow_downloads": False,
}

METRIC = {"multiple_choice": "acc", "generate_until": "exact_match"}
FILTER = {"multiple_choice": "none", "generate_until": "strip"}
TEMPLATE = {"multiple_choice": "multiple_choice.yaml", "generate_until": "generate_until.yaml"}


DTYPES = ("float32", "bfloat16", "float16", "auto")


def merge_cfg(cfg: Mapping[str, Any] | None) -> dict[str, Any]:
    """Return DEFAULTS overridden by cfg; unknown keys and bad values are an InputError
    naming the field (checked with the config, before any job runs)."""
    out = merge_section(DEFAULTS, cfg, "evaluate")
    for key in ("batch_size", "max_gen_toks", "gpus", "shards", "builtin_max_gen_toks"):
        if key == "builtin_max_gen_toks" and out[key] is None:
            continue
        if out[key] < 1:
            raise InputError(f"must be a positive integer, got {out[key]!r}",
                             field=f"evaluate.{key}")
    if out["dtype"] not in DTYPES:
        raise InputError(f"unknown dtype {out['dtype']!r}; valid: {', '.join(DTYPES)}",
                         field="evaluate.dtype")
    if out["parallelize"] and str(out["device"]) == "cpu":
        raise InputError("parallelize splits the model over GPUs; it needs device auto or "
                         "cuda, not cpu", field="evaluate.parallelize")
    if out["gpus"] > 1 and not out["parallelize"]:
        raise InputError(f"{out['gpus']} GPUs per evaluate job need parallelize: true (one "
                         "model copy uses one GPU; the others would sit idle)",
                         field="evaluate.gpus")
    return out


def _templates_dir(cfg: Mapping[str, Any]) -> Path:
    if cfg.get("templates_dir"):
        return Path(cfg["templates_dir"])
    return Path(__file__).resolve().parents[2] / "tasks"


def _spec_get(spec: Any, key: str, default: Any = None) -> Any:
    if isinstance(spec, Mapping):
        return spec.get(key, default)
    return getattr(spec, key, default)


def validate_items(path: Path, output_type: str) -> list[dict]:
    """Read a benchmark JSONL file and check each item's fields for its output type."""
    items = read_jsonl(path)
    if not items:
        raise InputError("benchmark file has no items", path=str(path))
    for lineno, it in enumerate(items, start=1):
        def bad(field: str, what: str) -> InputError:
            return InputError(f"{what} (item id {it.get('id')!r})", path=str(path), line=lineno,
                              field=field)
        if not isinstance(it.get("prompt"), str) or not it["prompt"]:
            raise bad("prompt", "must be a non-empty string")
        if output_type == "multiple_choice":
            ch = it.get("choices")
            if not isinstance(ch, list) or len(ch) < 2 or not all(isinstance(c, str) for c in ch):
                raise bad("choices", "must be a list of at least 2 strings")
            lab = it.get("label")
            if isinstance(lab, bool) or not isinstance(lab, int) or not 0 <= lab < len(ch):
                raise bad("label", f"must be an int index into choices (0..{len(ch) - 1})")
        elif output_type == "generate_until":
            if not isinstance(it.get("answer"), str):
                raise bad("answer", "must be a string")
        else:
            raise InputError(f"unknown output_type {output_type!r}; use multiple_choice or "
                             "generate_until", path=str(path), field="output_type")
    return items


def infer_output_type(path: Path) -> str:
    """Guess a task's output type from its first item (choices -> multiple_choice)."""
    first = read_jsonl(path)[:1]
    if not first:
        raise InputError("benchmark file has no items", path=str(path))
    return "multiple_choice" if "choices" in first[0] else "generate_until"


def task_yaml(name: str, output_type: str, data_file: Path, cfg: Mapping[str, Any],
              unsafe_code: bool = False) -> dict[str, Any]:
    """Fill the template for one task; returns the YAML document as a dict."""
    tpl_path = _templates_dir(cfg) / TEMPLATE[output_type]
    if not tpl_path.exists():
        raise InputError("task template not found; check evaluate.templates_dir",
                         path=str(tpl_path))
    doc = yaml.safe_load(tpl_path.read_text(encoding="utf-8"))
    doc["task"] = name
    doc["dataset_kwargs"]["data_files"]["test"] = str(Path(data_file).resolve())
    doc["unsafe_code"] = bool(unsafe_code)
    if output_type == "generate_until":
        stops = list(cfg["stop_sequences"])
        if not stops or not all(isinstance(s, str) and s for s in stops):
            raise InputError("must be a non-empty list of non-empty strings",
                             field="evaluate.stop_sequences")
        doc["generation_kwargs"]["until"] = stops
        doc["generation_kwargs"]["max_gen_toks"] = int(cfg["max_gen_toks"])
    return doc


def _item_dirs(item_dirs: str | os.PathLike | Iterable[str | os.PathLike]) -> list[Path]:
    if isinstance(item_dirs, (str, os.PathLike)):
        return [Path(item_dirs)]
    return [Path(d) for d in item_dirs]


def _item_file(name: str, dirs: list[Path]) -> Path:
    """The task's item file: `<dir>/<name>.jsonl` in the first folder that has it."""
    for d in dirs:
        if (d / f"{name}.jsonl").exists():
            return d / f"{name}.jsonl"
    return dirs[0] / f"{name}.jsonl"


def split_builtin(tasks: Iterable[Any], item_dirs: Any) -> tuple[list[Any], list[str]]:
    """Split tasks into repo-defined ones (an item file exists or the registry names it) and
    lm-eval built-in task names (config/paper.yaml's `tasks.lm_eval_tasks`)."""
    try:
        from clusterft.tasks.registry import TASKS as registry  # noqa: N811
    except ModuleNotFoundError:
        registry = {}
    dirs = _item_dirs(item_dirs)
    repo, builtin = [], []
    for t in tasks:
        if isinstance(t, str) and t not in registry and not _item_file(t, dirs).exists():
            builtin.append(t)
        else:
            repo.append(t)
    return repo, builtin


def _resolve_specs(tasks: Iterable[Any], item_dirs: Any) -> list[dict[str, Any]]:
    """Normalise task names / TaskSpecs / dicts to dicts with name, output_type, unsafe_code.

    `item_dirs` is one folder or a list of folders holding `<task>.jsonl` item files."""
    try:
        from clusterft.tasks.registry import TASKS as registry  # noqa: N811
    except ModuleNotFoundError as e:  # no registry module: infer the type from the items
        if e.name != f"{__package__}.tasks":
            raise
        registry = {}
    out = []
    for t in tasks:
        spec = registry.get(t) if isinstance(t, str) else t
        name = t if isinstance(t, str) else _spec_get(t, "name")
        if not name:
            raise InputError(f"task {t!r} has no name", field="tasks")
        data_file = _item_file(name, _item_dirs(item_dirs))
        otype = _spec_get(spec, "output_type") if spec is not None else None
        otype = otype or infer_output_type(data_file)
        if otype not in METRIC:
            raise InputError(f"unknown output_type {otype!r}", field=f"tasks.{name}.output_type")
        out.append({"name": name, "output_type": otype, "data_file": data_file,
                    "unsafe_code": bool(_spec_get(spec, "unsafe_code", False))})
    names = [s["name"] for s in out]
    if len(set(names)) != len(names):
        raise InputError(f"duplicate task names {names}", field="tasks")
    return out


def write_task_yamls(tasks: Iterable[Any], item_dirs: str | os.PathLike, out_dir: str | os.PathLike,
                     cfg: Mapping[str, Any] | None = None) -> list[str]:
    """Write one lm-eval task YAML per task into out_dir; returns their paths.

    `tasks`: task names (looked up in `clusterft.tasks.registry.TASKS`, else the output type is
    inferred from the items), TaskSpecs or dicts with `name`, `output_type` and optionally
    `unsafe_code`. Items are validated; data paths in the YAMLs are absolute.
    """
    cfg = merge_cfg(cfg)
    paths = []
    for spec in _resolve_specs(tasks, item_dirs):
        validate_items(spec["data_file"], spec["output_type"])
        data_file = plain_jsonl(spec["data_file"], Path(out_dir) / f"{spec['name']}.items.jsonl")
        doc = task_yaml(spec["name"], spec["output_type"], data_file, cfg, spec["unsafe_code"])
        path = Path(out_dir) / f"{spec['name']}.yaml"
        write_text(path, yaml.safe_dump(doc, sort_keys=False, allow_unicode=True))
        paths.append(str(path))
    return paths


def plain_jsonl(path: str | os.PathLike, copy_to: Path) -> Path:
    """``path`` itself when it is plain JSONL (no byte-order mark, LF line ends), else a
    plain copy at ``copy_to``: lm-eval's own JSON loader is stricter than our readers."""
    raw = Path(path).read_bytes()
    if not raw.startswith(BOM) and b"\r" not in raw:
        return Path(path)
    write_jsonl(copy_to, read_jsonl(path))
    return copy_to


BUILTIN_METRICS = ("acc,none", "exact_match,strict-match", "exact_match,none", "pass@1,create_test",
                   "pass_at_1,none", "pass@1,none")


def summarize(raw: Mapping[str, Any], specs: list[dict[str, Any]],
              builtin: Iterable[str] = ()) -> dict[str, Any]:
    """Turn lm-eval's results dict into the design's results.json format.

    Built-in lm-eval tasks report the first metric of BUILTIN_METRICS they have."""
    tasks = {}
    for name in builtin:
        res = raw["results"].get(name)
        if res is None:
            raise RuntimeError(f"lm-eval returned no results for task {name!r}")
        key = next((k for k in BUILTIN_METRICS if k in res), None)
        if key is None:
            raise RuntimeError(f"task {name!r}: none of the metrics {BUILTIN_METRICS} in {sorted(res)}")
        metric, filt = key.split(",", 1)
        stderr = res.get(f"{metric}_stderr,{filt}")
        n = raw.get("n-samples", {}).get(name, {}).get("effective", 0)
        tasks[name] = {"metric": metric, "filter": filt, "value": float(res[key]),
                       "stderr": float(stderr) if isinstance(stderr, (int, float)) else float("nan"),
                       "n": int(n)}
    for s in specs:
        name, otype = s["name"], s["output_type"]
        res = raw["results"].get(name)
        if res is None:
            raise RuntimeError(f"lm-eval returned no results for task {name!r}")
        metric, filt = METRIC[otype], FILTER[otype]
        value = res[f"{metric},{filt}"]
        stderr = res.get(f"{metric}_stderr,{filt}")
        stderr = float(stderr) if isinstance(stderr, (int, float)) else float("nan")
        n = raw.get("n-samples", {}).get(name, {}).get("effective")
        tasks[name] = {"metric": metric, "filter": filt, "value": float(value), "stderr": stderr,
                       "n": int(n)}
    values = [t["value"] for t in tasks.values()]
    return {"tasks": tasks, "average": float(sum(values) / len(values))}


def item_results(raw: Mapping[str, Any], summary: Mapping[str, Any]):
    """Per-item scores from lm-eval's logged samples (one row per task and item: ``task``,
    ``doc_id``, ``item`` = the item's own id, ``value`` = the task's summary metric under its
    filter), for paired comparisons of two runs on the same items. Each task's mean equals
    its summary value (checked)."""
    import pandas as pd

    rows = []
    for name, t in summary["tasks"].items():
        samples = [x for x in raw.get("samples", {}).get(name, [])
                   if x.get("filter", t["filter"]) == t["filter"]]
        vals = []
        for x in samples:
            doc = x.get("doc") or {}
            vals.append(float(x[t["metric"]]))
            rows.append({"task": name, "doc_id": int(x["doc_id"]),
                         "item": str(doc.get("id", x["doc_id"])), "value": vals[-1]})
        if not vals or abs(sum(vals) / len(vals) - t["value"]) > 1e-9:
            raise RuntimeError(f"task {name!r}: lm-eval logged {len(vals)} samples whose mean "
                               f"does not give the reported {t['metric']} {t['value']}")
    return pd.DataFrame(rows, columns=["task", "doc_id", "item", "value"])


_DROP = object()


def _jsonable(obj: Any) -> Any:
    """Recursively keep what JSON can hold; numpy scalars become numbers, the rest is dropped."""
    if isinstance(obj, Mapping):
        out = {}
        for k, v in obj.items():
            v2 = _jsonable(v)
            if v2 is not _DROP:
                out[str(k)] = v2
        return out
    if isinstance(obj, (list, tuple)):
        return [x for x in (_jsonable(v) for v in obj) if x is not _DROP]
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if hasattr(obj, "item") and callable(obj.item):  # numpy / torch scalars
        try:
            return _jsonable(obj.item())
        except (TypeError, ValueError):
            return _DROP
    return _DROP



@contextlib.contextmanager
def _light_env_info(enabled: bool) -> Iterator[None]:
    """Unless enabled, replace lm-eval's add_env_info (torch collect_env) by version numbers."""
    import lm_eval.evaluator as ev
    if enabled:
        yield
        return

    def add_versions(storage: dict[str, Any]) -> None:
        import torch
        import transformers
        storage.update({"pretty_env_info": "skipped (evaluate.collect_env_info: false)",
                        "torch_version": torch.__version__,
                        "transformers_version": transformers.__version__,
                        "lm_eval_version": importlib.metadata.version("lm_eval")})

    original = ev.add_env_info
    ev.add_env_info = add_versions
    try:
        yield
    finally:
        ev.add_env_info = original


def check_context_lengths(model_dir: str, specs: list[dict[str, Any]], cfg: Mapping[str, Any]
                          ) -> dict[str, int]:
    """Count, per task, the prompts (+ longest choice or max_gen_toks) over the context length."""
    from transformers import AutoConfig, AutoTokenizer

    config_dir = adapter_base(model_dir) or model_dir  # an adapter folder holds no config.json
    max_len = cfg.get("max_length") or getattr(AutoConfig.from_pretrained(config_dir),
                                              "max_position_embeddings", None)
    if not max_len:
        return {}
    tok = AutoTokenizer.from_pretrained(model_dir)
    over = {}
    for s in specs:
        items = read_jsonl(s["data_file"])
        n = 0
        for it in items:
            need = len(tok(it["prompt"])["input_ids"])
            if s["output_type"] == "multiple_choice":
                need += max(len(tok(c, add_special_tokens=False)["input_ids"])
                            for c in it["choices"])
            else:
                need += int(cfg["max_gen_toks"])
            n += need > max_len
        if n:
            log.warning("task %s: %d of %d items exceed the context length %d; lm-eval will "
                        "cut their prompts from the left", s["name"], n, len(items), max_len)
        over[s["name"]] = n
    return over


PACED_MODEL = "clusterft-hf"


def _register_paced_model() -> str:
    """Register lm-eval's ``hf`` model with pace lines in the log (`clusterft.pipeline.pace`).

    The subclass only counts the rows of each model call (same batches, same results as
    ``hf``; the raw ``*.lm_eval.json`` names the model ``clusterft-hf``). The total is the
    number of requests: multiple-choice requests that share a context and a one-token
    continuation are computed once, so such a run finishes before the expected time, never
    after it. ``loglikelihood_rolling`` (perplexity tasks; none in this repo) is not paced.
    """
    from lm_eval.api.registry import MODEL_REGISTRY, register_model
    from lm_eval.models.huggingface import HFLM

    if PACED_MODEL in MODEL_REGISTRY:
        return PACED_MODEL
    from clusterft.pipeline.pace import Pace, on_terminal

    class PacedHFLM(HFLM):
        _pace: Pace | None = None

        def _paced(self, requests, what, run):
            self._pace = Pace(len(requests), f"evaluate {what}", unit="request", bar=False,
                              disable=self.rank != 0)
            try:
                return run()
            finally:
                self._pace.close()
                self._pace = None

        def _tick(self, rows: int) -> None:
            if self._pace is not None:
                self._pace.update(rows)

        # lm-eval's bars only on a terminal: a rule's log gets the pace lines alone
        def loglikelihood(self, requests, disable_tqdm: bool = False):
            quiet = disable_tqdm or not on_terminal()
            return self._paced(requests, "loglikelihood",
                               lambda: super(PacedHFLM, self).loglikelihood(requests, quiet))

        def generate_until(self, requests, disable_tqdm: bool = False):
            quiet = disable_tqdm or not on_terminal()
            return self._paced(requests, "generate_until",
                               lambda: super(PacedHFLM, self).generate_until(requests, quiet))

        def _model_call(self, inps, attn_mask=None, labels=None):
            out = super()._model_call(inps, attn_mask=attn_mask, labels=labels)
            self._tick(int(inps.shape[0]))
            return out

        def _model_generate(self, context, max_length, stop, **generation_kwargs):
            out = super()._model_generate(context, max_length, stop, **generation_kwargs)
            self._tick(int(context.shape[0]))
            return out

    register_model(PACED_MODEL)(PacedHFLM)
    return PACED_MODEL


def lm_eval_model_args(model_dir: str | os.PathLike, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """lm-eval's `hf` model arguments for a model folder: a plain folder is `pretrained`; a
    LoRA run's peft adapter folder loads its base as `pretrained` with the adapter as `peft`
    (lm-eval applies it) and the run's tokenizer, so no merged copy is ever written."""
    base = adapter_base(model_dir)
    args: dict[str, Any] = {"pretrained": str(model_dir), "dtype": cfg["dtype"]}
    if base is not None:
        if Path(base).exists():  # a folder here: absolute (lm-eval may run in the mirror)
            base = str(Path(base).resolve())
        args.update(pretrained=base, peft=str(model_dir), tokenizer=str(model_dir))
    return args


def run_evaluate(model_dir: str | os.PathLike, tasks: list[Any],
                 item_dirs: str | os.PathLike | list[str | os.PathLike],
                 cfg: Mapping[str, Any] | None, out_json: str | os.PathLike,
                 tasks_dir: str | os.PathLike, seed: int = 0,
                 out_items: str | os.PathLike | None = None,
                 mirror: str | os.PathLike | None = None) -> dict[str, Any]:
    """Evaluate `model_dir` on `tasks` (one lm-eval call); write results.json and the raw results.

    `mirror`: the download rule's dataset mirror, where lm-eval's built-in tasks read their
    hub datasets (and humaneval/mbpp their code_eval metric) offline.

    Returns the summary written to `out_json`. The raw lm-eval results (without per-sample
    logs and non-JSON values) go to `<out_json stem>.lm_eval.json` beside it; the per-item
    scores (``item_results``) to ``out_items`` (parquet) when given.
    """
    cfg = merge_cfg(cfg)
    set_offline_env(cfg["allow_downloads"])
    cpu_matmul.from_env()
    model_dir = str(Path(model_dir).resolve())
    base = adapter_base(model_dir)
    if base is None and not (Path(model_dir) / "config.json").exists():
        raise InputError("not a model directory (no config.json, nor a peft adapter's "
                         "adapter_config.json)", path=model_dir)
    if base is not None and not (Path(base) / "config.json").exists():
        raise InputError(f"the adapter's base model '{base}' is not a model folder here "
                         "(adapter_config.json, base_model_name_or_path): evaluate from the "
                         "folder the run trained in, or edit that path", path=model_dir)
    if not tasks:
        raise InputError("no tasks to evaluate", field="tasks")
    check_weights(model_dir, "evaluate model")
    checked = provenance.check_inputs(
        {"model": model_dir, "items": [d for d in _item_dirs(item_dirs) if Path(d).is_dir()]},
        "evaluate")
    repo_tasks, builtin = split_builtin(tasks, item_dirs)
    specs = _resolve_specs(repo_tasks, item_dirs)
    if builtin and not cfg["allow_builtin_tasks"]:
        raise InputError(f"tasks {builtin} are neither repo-defined benchmarks nor item files in "
                         f"{[str(d) for d in _item_dirs(item_dirs)]}; lm-eval built-in tasks "
                         "need evaluate.allow_builtin_tasks: true", field="tasks")
    unsafe = [s["name"] for s in specs if s["unsafe_code"]]
    if unsafe and not cfg["confirm_run_unsafe_code"]:
        raise InputError(f"tasks {unsafe} execute model-written code; set "
                         "evaluate.confirm_run_unsafe_code: true to run them",
                         field="evaluate.confirm_run_unsafe_code")
    write_task_yamls([{k: s[k] for k in ("name", "output_type", "unsafe_code")} for s in specs],
                     item_dirs, tasks_dir, cfg)
    if cfg["confirm_run_unsafe_code"]:
        # The hub's code_eval metric (lm-eval's humaneval, mbpp) refuses to run, already when
        # their task modules are imported, unless this is set; the config has confirmed it.
        os.environ["HF_ALLOW_CODE_EVAL"] = "1"

    import torch
    if cfg["num_threads"]:
        torch.set_num_threads(int(cfg["num_threads"]))
    over = check_context_lengths(model_dir, specs, cfg)

    t0 = time.perf_counter()
    import lm_eval
    from lm_eval.tasks import TaskManager
    t_import = time.perf_counter() - t0

    model_args = lm_eval_model_args(model_dir, cfg)
    if cfg["parallelize"]:
        model_args["parallelize"] = True
    if cfg["max_length"]:
        model_args["max_length"] = int(cfg["max_length"])
    # include_defaults=False: index only our YAMLs (no clash with built-in task names such
    # as mbpp/humaneval, and no scan of lm-eval's thousands of task files).
    # Built-in lm-eval tasks (paper config) need the default index too.
    Path(tasks_dir).mkdir(parents=True, exist_ok=True)
    tm = TaskManager(include_path=str(Path(tasks_dir).resolve()), include_defaults=bool(builtin))
    from clusterft.pipeline.pace import bars_only_on_terminal

    # lm-eval's other bars (building each task's requests, bootstrap) too: terminal only
    from clusterft.pipeline.mirror import resolving_in

    with _light_env_info(bool(cfg["collect_env_info"])), bars_only_on_terminal(), \
            resolving_in(mirror if builtin else None):
        raw = lm_eval.simple_evaluate(
            model=_register_paced_model(), model_args=model_args, tasks=[s["name"] for s in specs] + builtin, task_manager=tm,
            batch_size=int(cfg["batch_size"]), device=resolve_device(cfg["device"], "evaluate.device"),
            limit=cfg["limit"], log_samples=out_items is not None, bootstrap_iters=int(cfg["bootstrap_iters"]),
            random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
            fewshot_random_seed=seed, confirm_run_unsafe_code=bool(cfg["confirm_run_unsafe_code"]),
            # One prompt format everywhere (docs/paper_path.md, "Prompt format"): no chat
            # template, in lm-eval as in training and scoring (Llama-2 base has none).
            apply_chat_template=False,
            **({"gen_kwargs": {"max_gen_toks": int(cfg["builtin_max_gen_toks"])}}
               if builtin and cfg["builtin_max_gen_toks"] else {}),
        )
    wall = time.perf_counter() - t0
    summary = summarize(raw, specs, builtin)
    summary["meta"] = {"model_dir": model_dir, "seed": seed, "limit": cfg["limit"],
                       "batch_size": int(cfg["batch_size"]), "wall_time_s": round(wall, 3),
                       "lm_eval_import_s": round(t_import, 3),
                       "items_over_context": over, "chat_template": False}
    out_json = Path(out_json)
    raw_path = out_json.with_name(out_json.stem + ".lm_eval.json")
    outputs = {"results": out_json, "raw": raw_path}
    if out_items is not None:
        from clusterft.pipeline.io import write_parquet

        write_parquet(out_items, item_results(raw, summary))
        outputs["items"] = out_items
    raw.pop("samples", None)
    write_text(raw_path, json.dumps(_jsonable(raw), indent=2) + "\n")
    write_json(out_json, summary)
    provenance.write(outputs, "evaluate", checked,
                     inherit=("model",), config=dict(cfg), seed=seed)
    return summary


def run_evaluate_many(model_dirs: list[str | os.PathLike], tasks: list[Any],
                      item_dirs: str | os.PathLike | list[str | os.PathLike],
                      cfg: Mapping[str, Any] | None, out_json: list[str | os.PathLike],
                      tasks_dir: list[str | os.PathLike], seeds: list[int],
                      out_items: list[str | os.PathLike] | None = None,
                      mirror: str | os.PathLike | None = None) -> list[dict[str, Any]]:
    """`run_evaluate` for several models (one run's seeds) one after the other in this
    process: lm-eval, torch and transformers are imported once, and each model is evaluated
    exactly as a job of its own would (its seed, its own outputs). Every model directory is
    checked before the first evaluation starts."""
    n = len(model_dirs)
    lists = {"out_json": out_json, "tasks_dir": tasks_dir, "seeds": seeds}
    if out_items is not None:
        lists["out_items"] = out_items
    for name, values in lists.items():
        if len(values) != n:
            raise InputError(f"{name} has {len(values)} entries for {n} models: give one "
                             "per model", field=name)
    for d in model_dirs:
        if not (Path(d) / "config.json").exists():
            raise InputError("not a model directory (no config.json)", path=str(d))
    out = []
    for i in range(n):
        log.info("model %d of %d: %s (seed %d)", i + 1, n, model_dirs[i], seeds[i])
        out.append(run_evaluate(model_dirs[i], tasks, item_dirs, cfg, out_json=out_json[i],
                                tasks_dir=tasks_dir[i], seed=int(seeds[i]),
                                out_items=None if out_items is None else out_items[i],
                                mirror=mirror))
    return out


def shard_tasks(tasks: list[Any], shards: int) -> list[list[Any]]:
    """Deal a run's tasks round-robin into at most `shards` non-empty groups (fewer where
    there are fewer tasks): group i holds tasks i, i+n, i+2n, ... of the list.

    A task is never split: lm-eval scores each task's items within one call, so a task's
    results do not depend on which other tasks share its job."""
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise InputError(f"must be a positive integer, got {shards!r}", field="evaluate.shards")
    n = min(shards, len(tasks))
    return [list(tasks[i::n]) for i in range(n)]


# lm-eval result keys that map task (or group) name -> value; merged by union over shards.
_PER_TASK_KEYS = ("results", "groups", "group_subtasks", "configs", "versions", "n-shot",
                  "higher_is_better", "n-samples", "task_hashes")


def merge_raw(raws: list[Mapping[str, Any]], order: list[str]) -> dict[str, Any]:
    """One lm-eval results dict from the shards' raw results: per-task maps united (tasks in
    `order`, then any group entries), run-level fields from the first shard, the evaluation
    time summed and the start/end times widened; `clusterft_shards` lists each shard's
    tasks."""
    out: dict[str, Any] = dict(raws[0])
    rank = {name: i for i, name in enumerate(order)}
    for key in _PER_TASK_KEYS:
        if not any(key in r for r in raws):
            continue
        merged: dict[str, Any] = {}
        for r in raws:
            merged.update(r.get(key) or {})
        out[key] = {k: merged[k] for k in sorted(merged, key=lambda k: rank.get(k, len(rank)))}
    times = [r.get("total_evaluation_time_seconds") for r in raws]
    if all(t is not None for t in times):
        out["total_evaluation_time_seconds"] = str(sum(float(t) for t in times))
    for key, pick in (("start_time", min), ("end_time", max)):
        vals = [r[key] for r in raws if isinstance(r.get(key), (int, float))]
        if vals:
            out[key] = pick(vals)
    out["clusterft_shards"] = [list((r.get("results") or {}).keys()) for r in raws]
    return out


def merge_shards(shard_results: list[str | os.PathLike], tasks: list[Any],
                 item_dirs: str | os.PathLike | list[str | os.PathLike],
                 cfg: Mapping[str, Any] | None, out_json: str | os.PathLike,
                 tasks_dir: str | os.PathLike, seed: int = 0,
                 out_items: str | os.PathLike | None = None) -> dict[str, Any]:
    """Merge the shards of one run's evaluation (each a `run_evaluate` output: results.json
    with `<stem>.lm_eval.json` and, with `out_items`, items.parquet beside it) into the
    outputs one `run_evaluate` over all `tasks` writes: the same task results, average,
    per-item rows (tasks in the run's order) and task YAMLs; `meta` sums the shards' times.

    Every task must come from exactly one shard, and all shards from the same model and seed
    (InputError naming the shard file otherwise)."""
    import pandas as pd

    from clusterft.pipeline.io import read_json, write_parquet

    cfg = merge_cfg(cfg)
    if not shard_results:
        raise InputError("no evaluation shards to merge", field="evaluate.shards")
    paths = [Path(p) for p in shard_results]
    raw_paths = [p.with_name(p.stem + ".lm_eval.json") for p in paths]
    item_paths = [p.with_name("items.parquet") for p in paths] if out_items is not None else []
    checked = provenance.check_inputs({"shards": paths, "raw": raw_paths, "items": item_paths},
                                      "evaluate merge")
    repo_tasks, builtin = split_builtin(tasks, item_dirs)
    order = list(builtin) + [s["name"] for s in _resolve_specs(repo_tasks, item_dirs)]
    summaries = [read_json(p) for p in paths]
    seen: dict[str, Path] = {}
    for p, s in zip(paths, summaries):
        if not isinstance(s, dict) or not isinstance(s.get("tasks"), dict):
            raise InputError("evaluation shard needs a 'tasks' object", path=str(p), field="tasks")
        for name in s["tasks"]:
            if name in seen:
                raise InputError(f"task {name!r} is also in shard {seen[name]}", path=str(p),
                                 field=f"tasks.{name}")
            if name not in order:
                raise InputError(f"task {name!r} is not one of the run's tasks {order}",
                                 path=str(p), field=f"tasks.{name}")
            seen[name] = p
        for key in ("model_dir", "seed"):
            if s.get("meta", {}).get(key) != summaries[0].get("meta", {}).get(key):
                raise InputError(f"shards of one run differ in {key}: "
                                 f"{s.get('meta', {}).get(key)!r} here, "
                                 f"{summaries[0].get('meta', {}).get(key)!r} in {paths[0]}",
                                 path=str(p), field=f"meta.{key}")
    missing = [t for t in order if t not in seen]
    if missing:
        raise InputError(f"no shard evaluated tasks {missing}",
                         path=str(paths[0].parent.parent), field="tasks")
    write_task_yamls([{k: s[k] for k in ("name", "output_type", "unsafe_code")}
                      for s in _resolve_specs(repo_tasks, item_dirs)], item_dirs, tasks_dir, cfg)
    Path(tasks_dir).mkdir(parents=True, exist_ok=True)
    by_task = {name: t for s in summaries for name, t in s["tasks"].items()}
    task_results = {name: by_task[name] for name in order}
    values = [t["value"] for t in task_results.values()]
    metas = [s.get("meta", {}) for s in summaries]
    over = {k: v for m in metas for k, v in (m.get("items_over_context") or {}).items()}
    summary = {"tasks": task_results, "average": float(sum(values) / len(values)),
               "meta": {"model_dir": metas[0].get("model_dir"), "seed": metas[0].get("seed"),
                        "limit": cfg["limit"], "batch_size": int(cfg["batch_size"]),
                        "wall_time_s": round(sum(m.get("wall_time_s", 0.0) for m in metas), 3),
                        "lm_eval_import_s": round(sum(m.get("lm_eval_import_s", 0.0)
                                                      for m in metas), 3),
                        "items_over_context": {k: over[k] for k in order if k in over},
                        "shards": [list(s["tasks"]) for s in summaries]}}
    out_json = Path(out_json)
    raw_path = out_json.with_name(out_json.stem + ".lm_eval.json")
    outputs = {"results": out_json, "raw": raw_path}
    if out_items is not None:
        frames = [pd.read_parquet(p) for p in item_paths]
        items = pd.concat(frames, ignore_index=True)
        rank = {name: i for i, name in enumerate(order)}
        items = items.iloc[items["task"].map(rank).argsort(kind="stable")].reset_index(drop=True)
        for name, t in task_results.items():
            vals = items.loc[items["task"] == name, "value"]
            if vals.empty or abs(vals.mean() - t["value"]) > 1e-9:
                raise InputError(f"task {name!r}: the shard's per-item scores do not give its "
                                 f"{t['metric']} {t['value']}", path=str(seen[name]),
                                 field=f"tasks.{name}")
        write_parquet(out_items, items)
        outputs["items"] = out_items
    raw = merge_raw([read_json(p) for p in raw_paths], order)
    for name, conf in (raw.get("configs") or {}).items():  # the merged tasks/ YAML, same text
        meta = conf.get("metadata") if isinstance(conf, dict) else None
        own = Path(tasks_dir).resolve() / f"{name}.yaml"
        if isinstance(meta, dict) and meta.get("config_source") and own.exists():
            meta["config_source"] = str(own)
    write_text(raw_path, json.dumps(_jsonable(raw), indent=2) + "\n")
    write_json(out_json, summary)
    provenance.write(outputs, "evaluate", checked, inherit=("shards",), config=dict(cfg),
                     seed=seed)
    return summary
