"""Config loading and the checks that go beyond the JSON schema.

The schema (`workflow/schemas/config.schema.yaml`) gives the config's shape; `validate_schema`
adds the enums the code owns and checks each stage section's keys and types against that
stage's DEFAULTS; `check_config` then checks what neither can (paths that must exist, tasks
that must be defined, cluster counts against pool sizes), before any expensive stage starts.
"""

from __future__ import annotations

import copy
import re
import warnings
from pathlib import Path
from typing import Any

import yaml

from clusterft.pipeline.errors import InputError
from clusterft.pipeline.io import read_text
from clusterft.pipeline.hardware import cuda_visible, emulated_bf16_message, native_bf16_cpu
from clusterft.pipeline.names import DISTRIBUTIONS, METHODS, REFERENCES, TARGET_AWARE
from clusterft.modeling.tokenize import POLICIES

SCHEMA = Path(__file__).resolve().parents[2] / "schemas" / "config.schema.yaml"
# The train keys a dataset may set for its own runs (`datasets.<name>.train`, merged over
# the model's train section): the ones that change neither a job's placement (GPUs, nodes)
# nor its memory, which stay per model.
DATASET_TRAIN_KEYS = ("epochs", "lr")


def budget_label(budget: float) -> str:
    """Budget as it appears in paths: 0.31 -> '0.31', 1.0 -> '1'."""
    return f"{float(budget):g}"


def load_config(path: str | Path, validate: bool = True) -> dict:
    """Read a YAML config, validate it against the schema and the extra checks."""
    p = Path(path)
    if not p.exists():
        raise InputError("config file does not exist", path=str(p))
    try:
        cfg = yaml.safe_load(read_text(p)) or {}
    except UnicodeDecodeError as e:
        raise InputError(f"not UTF-8 ({e.reason} at byte {e.start}); save the config as UTF-8",
                         path=str(p)) from e
    except yaml.YAMLError as e:
        raise InputError(f"malformed YAML: {e}", path=str(p)) from e
    if validate:
        prepare(cfg, source=str(p), warn=lambda msg: warnings.warn(msg, stacklevel=3))
    return cfg


def yaml_line(source: str | Path | None, field: str) -> int | None:
    """1-based line of config field `field` ("a.b.1", "a.b[1]" or "a.b") in the YAML file
    `source`; the deepest key found on the way if the field itself is not written there
    (None if `source` is not a readable file)."""
    if not source:
        return None
    try:
        text = read_text(source)
        node = yaml.compose(text)
    except (OSError, ValueError, yaml.YAMLError):
        return None
    line = None
    for part in re.findall(r"[^.\[\]]+", field):
        if isinstance(node, yaml.MappingNode):
            nxt = next(((k, v) for k, v in node.value if getattr(k, "value", None) == part), None)
            if nxt is None:
                break
            line, node = nxt[0].start_mark.line + 1, nxt[1]
        elif isinstance(node, yaml.SequenceNode) and part.isdigit() and int(part) < len(node.value):
            node = node.value[int(part)]
            line = node.start_mark.line + 1
        else:
            break
    return line


def config_error(message: str, source: str | None, field: str) -> InputError:
    """InputError naming the config file, the line of `field` in it (if found) and `field`."""
    return InputError(message, path=source, line=yaml_line(source, field), field=field)


def schema() -> dict:
    """The JSON schema with the enums whose names the code owns filled in from the code."""
    from clusterft.stages.data import prepare as data
    from clusterft.stages.data import decontaminate
    from clusterft.tasks.registry import DOMAINS
    from clusterft.stages.models import SOURCES

    out = yaml.safe_load(SCHEMA.read_text(encoding="utf-8"))
    sweep = out["properties"]["sweep"]["properties"]
    named = [(sweep["methods"]["items"], METHODS),
             (sweep["time"]["properties"]["methods"]["items"], METHODS),
             (sweep["accuracy"]["properties"]["distribution"], DISTRIBUTIONS),
             (sweep["time"]["properties"]["distributions"]["items"], DISTRIBUTIONS),
             (out["properties"]["tasks"]["properties"]["decontaminate"], decontaminate.ACTIONS),
             (out["$defs"]["dataset"]["properties"]["domain"], DOMAINS),
             (out["$defs"]["dataset"]["properties"]["source"], tuple(data.DEFAULTS)),
             (out["$defs"]["model"]["properties"]["source"], SOURCES)]
    for node, names in named:
        node.pop("type", None)
        node["enum"] = list(names)
    # Defaults the code owns (written once, in the stage module that reads them).
    tasks = out["properties"]["tasks"]["properties"]
    tasks["decontaminate"]["default"] = decontaminate.DEFAULTS["action"]
    tasks["max_overlap"]["default"] = decontaminate.DEFAULTS["max_overlap"]
    return out


def validate_schema(cfg: dict, source: str = "config") -> None:
    """Validate against the JSON schema (as Snakemake does), then every stage section's keys
    and types against that stage's DEFAULTS; the first error names the file, line, field."""
    import jsonschema

    sch = schema()
    validator_cls = jsonschema.validators.validator_for(sch)
    errors = sorted(validator_cls(sch).iter_errors(cfg), key=lambda e: list(e.path))
    if errors:
        e = errors[0]
        field = ".".join(str(x) for x in e.absolute_path) or "(top level)"
        message = e.message
        if e.validator == "additionalProperties" and "unexpected" in message:
            extra = sorted(set(e.instance) - set(e.schema.get("properties", {})))
            if extra:  # name the unknown key itself, and what is allowed there
                field = ".".join([*map(str, e.absolute_path), str(extra[0])])
                message = (f"unknown key '{extra[0]}'; allowed here: "
                           f"{', '.join(sorted(e.schema.get('properties', {})))}")
                if field == "benchmarks":  # renamed: the evaluation side is called tasks
                    message += " (the 'benchmarks' section is now 'tasks', its 'tasks' list 'only')"
        raise config_error(message, source, field)
    try:
        check_sections(cfg)
    except InputError as e:
        raise config_error(e.message, source, e.field or "(top level)") from e


def check_sections(cfg: dict) -> None:
    """Keys and types of each stage section, dataset and model override, against the
    DEFAULTS of the module that reads them (InputError naming the field)."""
    from clusterft.stages.data import prepare as data
    from clusterft.stages import evaluate
    from clusterft.modeling import pretrain
    from clusterft.stages import models
    from clusterft.stages import train
    from clusterft.pipeline.sections import check_keys
    from clusterft.modeling import lengths

    for name, defaults in stage_defaults().items():  # tokenizer included
        check_keys(defaults, cfg.get(name), name)
        if "max_length_quantile" in defaults:  # score, features, train: max_length auto
            lengths.check_keys({**defaults, **(cfg.get(name) or {})}, name)
    evaluate.merge_cfg(cfg.get("evaluate"))  # values too: shards, gpus, dtype, parallelize
    for name, m in (cfg.get("models") or {}).items():
        check_keys(pretrain.DEFAULTS, m.get("pretrain"), f"models.{name}.pretrain")
        check_keys(models.PRACTICE_DEFAULTS, m.get("practice"), f"models.{name}.practice")
        check_keys(train.DEFAULTS, m.get("train"), f"models.{name}.train")
        lengths.check_keys({**train.DEFAULTS, **(m.get("train") or {})}, f"models.{name}.train")
    for name, d in (cfg.get("datasets") or {}).items():
        data.merge_cfg(d["source"], d, name)
        check_keys({k: train.DEFAULTS[k] for k in DATASET_TRAIN_KEYS}, d.get("train"),
                   f"datasets.{name}.train")


def stage_defaults() -> dict[str, dict]:
    """Each stage section's defaults: the DEFAULTS of the module that reads the section
    (the one place a default is written; check_sections checks the keys against them)."""
    from clusterft.stages import cluster, download, evaluate, models, report, score, select, train
    from clusterft.stages.data import corpus
    from clusterft.stages.features import representations as features

    return {"download": download.DEFAULTS, "corpus": corpus.DEFAULTS, "tokenizer": models.TOKENIZER_DEFAULTS,
            "score": score.DEFAULTS, "features": features.DEFAULTS, "cluster": cluster.DEFAULTS,
            "select": select.DEFAULTS, "train": train.DEFAULTS, "evaluate": evaluate.DEFAULTS,
            "report": report.DEFAULTS}


def fill_schema_defaults(cfg: dict) -> dict:
    """Set the schema's `default:`s into `cfg` in place (as Snakemake's `validate` does:
    a key with a default that the config leaves out gets it); returns `cfg`."""
    import jsonschema

    sch = schema()
    base = jsonschema.validators.validator_for(sch)
    props = base.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, node):
        if isinstance(instance, dict):
            for key, sub in properties.items():
                if "default" in sub:
                    instance.setdefault(key, copy.deepcopy(sub["default"]))
        yield from props(validator, properties, instance, node)

    filler = jsonschema.validators.extend(base, {"properties": set_defaults})
    for _ in filler(sch).iter_errors(cfg):
        pass  # validate_schema reports errors; this only fills
    return cfg


def settings(cfg: dict) -> dict:
    """The config as the workflow reads its values: a copy with the schema's defaults, every
    stage section merged over its module's DEFAULTS (`stage_defaults`), `tasks` over the
    decontaminate stage's, each model's train section (`model_train`: the train section with
    the model's own overrides; a run's adds its dataset's: `run_train`) and the sweep's
    optional groups written out (a group's models default to every model). Jobs' params
    keep the config's own sections (the stages merge their DEFAULTS), so a default changed
    in code does not count as a changed param."""
    from clusterft.pipeline.sections import merged
    from clusterft.stages.data import decontaminate
    from clusterft.stages.evaluate import merge_cfg as evaluate_cfg

    out = fill_schema_defaults(copy.deepcopy(cfg))
    for name, defaults in stage_defaults().items():
        out[name] = merged(copy.deepcopy(defaults), out.get(name) or {})
    out["evaluate"] = evaluate_cfg(cfg.get("evaluate"))
    action = {"decontaminate": decontaminate.DEFAULTS["action"],
              "max_overlap": decontaminate.DEFAULTS["max_overlap"]}
    out["tasks"] = {**action, **(out.get("tasks") or {})}
    models = list(out["models"])
    out["model_train"] = {m: merged(copy.deepcopy(out["train"]), spec.get("train") or {})
                          for m, spec in out["models"].items()}
    sweep = out["sweep"]
    datasets = list(out["datasets"])
    for group in ("curve", "baselines", "distribution_ablation"):
        sweep[group] = {"methods": [], "budgets": [], "distribution": None, "models": models,
                        "datasets": datasets, **(sweep.get(group) or {})}
    sweep["step_matched"] = {"methods": [], "models": models, "datasets": datasets,
                             **(sweep.get("step_matched") or {})}
    sweep["time"] = {"models": models, "datasets": datasets, "epochs": None, **sweep["time"]}
    return out


def dataset_train(cfg: dict, dataset: str) -> dict:
    """Dataset `dataset`'s own train overrides (`datasets.<name>.train`: DATASET_TRAIN_KEYS
    only), {} where it sets none."""
    return dict((cfg["datasets"][dataset] or {}).get("train") or {})


def run_train(cfg: dict, dataset: str, model: str) -> dict:
    """The train section a run of `dataset` on `model` trains with, in a settled config
    (`settings`): the model's (`model_train`: train's DEFAULTS, the train section, the
    model's overrides) with the dataset's own overrides merged over it."""
    from clusterft.pipeline.sections import merged

    return merged(copy.deepcopy(cfg["model_train"][model]), dataset_train(cfg, dataset))


def _kinds(cfg: dict, path: list[str]) -> set[str]:
    """The JSON types the schema (or, in a stage section, the key's default in the stage's
    DEFAULTS; in a dataset, its source's) gives config field `path` (empty: unknown)."""
    node = sch = schema()
    for i, key in enumerate(path):
        while "$ref" in node:
            node = {**sch["$defs"][node["$ref"].split("/")[-1]],
                    **{k: v for k, v in node.items() if k != "$ref"}}
        if node.get("type") == "array" or "items" in node:
            node = node.get("items") or {}
            continue
        props = node.get("properties") or {}
        if key in props:
            node = props[key]
            continue
        if isinstance(node.get("additionalProperties"), dict):
            node = node["additionalProperties"]
            continue
        defaults = _section_defaults(cfg, path[:i])
        for k in path[i:]:
            defaults = defaults.get(k) if isinstance(defaults, dict) else None
        return _default_kinds(defaults)
    while "$ref" in node:
        node = sch["$defs"][node["$ref"].split("/")[-1]]
    kinds = node.get("type") or []
    return {kinds} if isinstance(kinds, str) else set(kinds)


def _section_defaults(cfg: dict, path: list[str]) -> dict:
    """The DEFAULTS a section at `path` is checked against ({} where none)."""
    from clusterft.modeling import pretrain
    from clusterft.stages.data import prepare as data

    stages = stage_defaults()
    if len(path) == 1 and path[0] in stages:
        return stages[path[0]]
    if len(path) == 3 and path[0] == "models" and path[2] in ("train", "pretrain", "practice"):
        from clusterft.stages.models import PRACTICE_DEFAULTS

        return {"train": stages["train"], "pretrain": pretrain.DEFAULTS,
                "practice": PRACTICE_DEFAULTS}[path[2]]
    if len(path) == 2 and path[0] == "datasets":
        spec = (cfg.get("datasets") or {}).get(path[1]) or {}
        return data.DEFAULTS.get(spec.get("source"), {})
    return {}


def _default_kinds(default: Any) -> set[str]:
    if isinstance(default, bool):
        return {"boolean"}
    if isinstance(default, int):
        return {"integer"}
    if isinstance(default, float):
        return {"number"}
    if default is None:
        return {"integer", "number", "boolean", "null"}  # a null default takes any value
    return set()


def _typed(text: str, kinds: set[str]) -> Any:
    """`text` as the first of `kinds` it reads as cleanly (else `text` itself)."""
    if "integer" in kinds and re.fullmatch(r"[+-]?[0-9]+", text):
        return int(text)
    if "number" in kinds and re.fullmatch(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?",
                                          text):
        return int(text) if re.fullmatch(r"[+-]?[0-9]+", text) else float(text)
    if "boolean" in kinds and text.lower() in ("true", "false"):
        return text.lower() == "true"
    if "null" in kinds and text in ("null", "~"):
        return None
    return text


def override_fields(overrides: dict | None, prefix: tuple = ()) -> list[tuple]:
    """The leaf fields (key paths) a `--config` override sets."""
    out = []
    for k, v in (overrides or {}).items():
        path = (*prefix, str(k))
        out += override_fields(v, path) if isinstance(v, dict) and v else [path]
    return out


def coerce_overrides(cfg: dict, overrides: dict | None) -> None:
    """Snakemake hands nested `--config` values over as text (`score={"shards": 3}` gives
    score.shards '3'): each such value of `cfg` (in place) that reads cleanly as the type the
    schema (or the stage's DEFAULTS) wants there becomes that type; the rest stay text for
    the checks to name."""
    for path in override_fields(overrides):
        parent = cfg
        for k in path[:-1]:
            parent = parent.get(k) if isinstance(parent, dict) else None
        if not isinstance(parent, dict) or path[-1] not in parent:
            continue
        value, key = parent[path[-1]], path[-1]
        if isinstance(value, str):
            parent[key] = _typed(value, _kinds(cfg, list(path)))
        elif isinstance(value, list):
            kinds = _kinds(cfg, [*path, "0"])
            parent[key] = [_typed(v, kinds) if isinstance(v, str) else v for v in value]


def override_example(cfg: dict, field: str) -> str:
    """A `--config` argument that sets `field` to a value of the type it wants, e.g.
    --config 'score={"shards": 3}' (a list item's field: a one-item list)."""
    import json

    parts = re.findall(r"[^.\[\]]+", field)
    kinds = _kinds(cfg, parts)
    value: Any = (3 if "integer" in kinds else 0.5 if "number" in kinds
                  else True if "boolean" in kinds else "VALUE")
    if len(parts) == 1:
        return f"--config {parts[0]}={json.dumps(value)}"
    for part in reversed(parts[1:]):
        value = [value] if part.isdigit() else {part: value}
    return f"--config '{parts[0]}={json.dumps(value)}'"


def _from_override(field: str | None, fields: list[tuple]) -> bool:
    if not field:
        return False
    parts = tuple(re.findall(r"[^.\[\]]+", field))
    return any(p[:len(parts)] == parts or parts[:len(p)] == p for p in fields)


def prepare(cfg: dict, source: str = "config", overrides: dict | None = None,
            warn: Any = None) -> dict:
    """The workflow's one merge-and-validate step: `--config` overrides typed by the schema
    (`coerce_overrides`), the schema and stage checks (`validate_schema`, `check_config`;
    an error in a value an override set names `--config`, not a line of `source`), the
    schema's defaults set into `cfg` (in place) and each warning passed to `warn`. Returns
    `settings(cfg)`: every value the workflow reads, defaults from the stage modules."""
    fields = override_fields(overrides)
    coerce_overrides(cfg, overrides)
    try:
        validate_schema(cfg, source=source)
        fill_schema_defaults(cfg)
        check_config(cfg, source=source)
    except InputError as e:
        if not _from_override(e.field, fields):
            raise
        message = e.message.split(" (YAML reads a number")[0]  # a file's hint, not --config's
        raise InputError(
            f"{message} (set by --config; Snakemake hands a nested --config value over as "
            "text, converted to the type the field wants where it reads as one: write it "
            f"as {override_example(cfg, e.field)})", path="--config", field=e.field) from e
    for msg in config_warnings(cfg, source=source):
        (warn or (lambda m: warnings.warn(m, stacklevel=3)))(msg)
    return settings(cfg)


def count_records(path: str | Path, stop: int | None = None) -> int:
    """Non-blank lines of a JSONL file (counting stops at `stop`)."""
    n = 0
    with open(path, "rb") as f:
        for raw in f:
            if raw.strip():
                n += 1
                if stop is not None and n >= stop:
                    break
    return n


def tasks_for(cfg: dict, dataset: str) -> list[str]:
    """Benchmark task names evaluated for the runs of one dataset.

    Repo-defined tasks: those drawn from the dataset's own source (held-out items of the same
    generator), optionally restricted by `tasks.only`. With `tasks.lm_eval_tasks`
    (paper config): the lm-eval tasks of the dataset's domain.
    """
    bench = cfg.get("tasks", {})
    spec = cfg["datasets"][dataset]
    named = bench.get("lm_eval_tasks")
    if named:
        return list(named.get(spec["domain"], []))
    from clusterft.tasks.registry import TASKS

    only = bench.get("only")
    source = spec.get("source", dataset)
    return [t.name for t in TASKS.values()
            if t.dataset == source and (not only or t.name in only)]


def has_labels(spec: dict) -> bool:
    """Whether a dataset's pool comes with true labels (labels.parquet holds more than the
    placeholder): the built-in generators always; a user's JSONL with `label_field`; a hub
    or local HF dataset with a `label` column mapped."""
    source = spec.get("source")
    if source == "jsonl":
        return bool(spec.get("label_field"))
    if source == "hf":
        return bool((spec.get("columns") or {}).get("label"))
    return True


def domains_without_targets(cfg: dict) -> list[tuple[str, list[str]]]:
    """(domain, its tasks) of every domain of the config's datasets none of whose named
    lm-eval tasks has a dev split (clusterft.tasks.lm_eval_docs.DEV_SPLITS): LESS and RDS+
    have no targets there. Empty without tasks.lm_eval_tasks."""
    from clusterft.tasks.lm_eval_docs import has_dev_split

    if not (cfg.get("tasks") or {}).get("lm_eval_tasks"):
        return []
    out: list[tuple[str, list[str]]] = []
    for name, spec in cfg["datasets"].items():
        tasks = tasks_for(cfg, name)
        if not any(has_dev_split(t) for t in tasks) and spec["domain"] not in dict(out):
            out.append((spec["domain"], tasks))
    return out


def check_method_inputs(cfg: dict, source: str = "config") -> None:
    """Refuse, before any work, methods whose inputs the config cannot give: the oracle
    reads true labels, LESS and RDS+ read the benchmark tasks' validation items (written
    by prepare_data for the repo-defined tasks; for named lm-eval tasks, the dev items
    benchmark_docs takes from their dev splits: some task of each dataset's domain needs
    one)."""
    from clusterft.tasks.lm_eval_docs import dev_split

    sweep = cfg["sweep"]
    targetless = domains_without_targets(cfg)
    unlabelled = [d for d, spec in cfg["datasets"].items() if not has_labels(spec)]
    groups = (("methods", sweep["methods"]),
              ("baselines.methods", (sweep.get("baselines") or {}).get("methods", [])))
    for key, methods in groups:
        for i, m in enumerate(methods):
            if m in REFERENCES and unlabelled:
                raise config_error(
                    f"method '{m}' selects on the true labels, but dataset "
                    f"'{unlabelled[0]}' has none (map a `label` column under its columns, or "
                    f"`label_field` for a JSONL pool), or drop '{m}'", source, f"sweep.{key}[{i}]")
            if m in TARGET_AWARE and targetless:
                domain, tasks = targetless[0]
                why = "; ".join(f"{t}: {dev_split(t).why}" for t in tasks) or "no tasks"
                raise config_error(
                    f"method '{m}' selects by similarity to the benchmark tasks' dev items, "
                    f"but no lm-eval task of domain '{domain}' has a dev split to take them "
                    f"from ({why}); add such a task to tasks.lm_eval_tasks.{domain}, or drop "
                    f"'{m}'", source, f"sweep.{key}[{i}]")


def model_train_value(cfg: dict, model: str, key: str) -> tuple[Any, str]:
    """A train key as model `model` gets it (its own `train` override, else the train
    section) and the config field it comes from."""
    own = cfg["models"][model].get("train") or {}
    if key in own:
        return own[key], f"models.{model}.train.{key}"
    return (cfg.get("train") or {}).get(key), f"train.{key}"


def emulated_bf16_fields(cfg: dict) -> list[str]:
    """Config fields that ask for bf16 where this node's CPU would emulate it.

    Empty where the CPU has native bf16 (or its flags are unknown). Pretraining of a
    built model always runs on the CPU; fine-tuning and evaluation only where their device
    is cpu, or auto without an NVIDIA driver visible.
    """
    if native_bf16_cpu() is not False:
        return []

    def on_cpu(device: Any) -> bool:
        device = str(device or "auto")
        return device == "cpu" or (device == "auto" and not cuda_visible())

    out = []
    for name, m in (cfg.get("models") or {}).items():
        if m.get("source", "build") == "build" and (m.get("pretrain") or {}).get("precision") == "bf16":
            out.append(f"models.{name}.pretrain.precision")
        prec, field = model_train_value(cfg, name, "precision")
        if prec == "bf16" and on_cpu(model_train_value(cfg, name, "device")[0]):
            out.append(field)
    for section in ("score", "features"):  # their own precision and device
        sec = cfg.get(section) or {}
        if sec.get("precision") == "bf16" and on_cpu(sec.get("device")):
            out.append(f"{section}.precision")
    ev = cfg.get("evaluate") or {}
    if ev.get("dtype") == "bfloat16" and on_cpu(ev.get("device")):
        out.append("evaluate.dtype")
    return list(dict.fromkeys(out))


def config_warnings(cfg: dict, source: str = "config") -> list[str]:
    """What is allowed but likely unwanted, each naming the file, line and field: bf16 on a
    CPU that emulates it (the run is right, only slow; and a config may be checked on a
    login node for jobs that run elsewhere, so this is not an error)."""
    out = []
    for field in emulated_bf16_fields(cfg):
        line = yaml_line(source, field)
        at = f"{source}" + (f", line {line}" if line else "")
        out.append(f"{at}: {emulated_bf16_message(field)}")
    return out


def check_shards(cfg: dict, source: str = "config") -> None:
    """score.shards against every dataset's pool size, at config time, by the rule the score
    jobs apply to their pool (clusterft.stages.score.check_shards: an integer from 1 to the
    pool size, so each score_shard job gets at least one example)."""
    from clusterft.stages.score import DEFAULTS as SCORE_DEFAULTS
    from clusterft.stages.score import check_shards as shards_rule

    shards = (cfg.get("score") or {}).get("shards", SCORE_DEFAULTS["shards"])
    try:
        shards_rule(shards)
        for name, d in cfg["datasets"].items():
            n = d.get("n")
            if n is None and d.get("source") == "jsonl" and d.get("path") and Path(d["path"]).is_file():
                n = count_records(d["path"], stop=shards)
                n = n if n < shards else None
            shards_rule(shards, n, f"the pool of dataset '{name}'")
    except InputError as e:
        raise config_error(e.message, source, "score.shards") from None


def check_practice(cfg: dict, source: str = "config") -> None:
    """A practised model's practice pool must be one the cipher generator can make, and a
    cipher testbed fine-tuned on it must share its vocabulary (n_words) and keep to the keys
    practice does not use (n_skills <= 8): practice teaches the lookup over the testbed's
    words, never a testbed cipher."""
    from clusterft.pools import cipher
    from clusterft.stages.models import PRACTICE_DEFAULTS, practice_shape

    practised = {}
    for name, m in cfg["models"].items():
        p = {**PRACTICE_DEFAULTS, **(m.get("practice") or {})}
        if m.get("source", "build") != "build" or int(p["steps"]) <= 0:
            continue
        field = f"models.{name}.practice"
        try:
            cipher.check(practice_shape(p), field)
        except InputError as e:
            raise config_error(e.message, source, e.field or field) from e
        a = p["attempts"]
        if isinstance(a, bool) or not isinstance(a, int) or a < 1:
            raise config_error(f"must be an integer >= 1, got {a!r}", source,
                               f"{field}.attempts")
        if not 0.0 <= float(p["min_exact"]) <= 1.0:
            raise config_error(f"must lie in [0, 1] (a share of held-out items answered "
                               f"exactly), got {p['min_exact']!r}", source,
                               f"{field}.min_exact")
        practised[name] = p
    for dname, d in cfg["datasets"].items():
        if d.get("source") != "cipher":
            continue
        spec = {**cipher.DEFAULTS, **d}
        for mname in d.get("models") or list(cfg["models"]):
            p = practised.get(mname)
            if p is None:
                continue
            if int(spec["n_words"]) != int(p["n_words"]):
                raise config_error(
                    f"the testbed permutes {spec['n_words']} words but model '{mname}' practised "
                    f"ciphers over {p['n_words']} (models.{mname}.practice.n_words): set both "
                    "to the same vocabulary size", source, f"datasets.{dname}.n_words")
            if int(spec["n_skills"]) > len(cipher.KEYS) - len(cipher.PRACTICE_KEYS):
                raise config_error(
                    f"{spec['n_skills']} ciphers would reuse a practice key of model '{mname}'; "
                    f"at most {len(cipher.KEYS) - len(cipher.PRACTICE_KEYS)} on a practised "
                    "model", source, f"datasets.{dname}.n_skills")


def check_config(cfg: dict, source: str = "config") -> None:
    """Checks a schema cannot express; each error names the config field."""
    sweep = cfg["sweep"]
    curve = sweep.get("curve") or {}
    baselines = sweep.get("baselines") or {}
    ablation = sweep.get("distribution_ablation") or {}
    swept = list(sweep["methods"]) + list(baselines.get("methods", []))
    for name, d in cfg["datasets"].items():
        for i, m in enumerate(d.get("models") or []):
            if m not in cfg["models"]:
                raise config_error(f"model '{m}' is not defined under models; defined: "
                                   f"{', '.join(cfg['models'])}", source,
                                   f"datasets.{name}.models[{i}]")
    matched = sweep.get("step_matched") or {}
    quick = sweep.get("quick") or {}
    if quick.get("dataset") is not None and quick["dataset"] not in cfg["datasets"]:
        raise config_error(f"dataset '{quick['dataset']}' is not defined under datasets; "
                           f"defined: {', '.join(cfg['datasets'])}", source,
                           "sweep.quick.dataset")
    if quick.get("model") is not None and quick["model"] not in cfg["models"]:
        raise config_error(f"model '{quick['model']}' is not defined under models; defined: "
                           f"{', '.join(cfg['models'])}", source, "sweep.quick.model")
    for group in ("curve", "baselines", "distribution_ablation", "step_matched", "time"):
        for i, d in enumerate((sweep.get(group) or {}).get("datasets", []) or []):
            if d not in cfg["datasets"]:
                raise config_error(f"dataset '{d}' is not defined under datasets; defined: "
                                   f"{', '.join(cfg['datasets'])}", source,
                                   f"sweep.{group}.datasets[{i}]")
    for group in ("curve", "baselines", "distribution_ablation", "step_matched"):
        for i, m in enumerate((sweep.get(group) or {}).get("models", []) or []):
            if m not in cfg["models"]:
                raise config_error(f"model '{m}' is not defined under models; defined: "
                                   f"{', '.join(cfg['models'])}", source,
                                   f"sweep.{group}.models[{i}]")
    for key, budgets in (("budgets", sweep["budgets"]),
                         ("curve.budgets", curve.get("budgets", [])),
                         ("time.budgets", sweep.get("time", {}).get("budgets", []))):
        for i, b in enumerate(budgets):
            if not 0 < float(b) <= 1:
                raise config_error(f"budget {b} is outside (0, 1]", source, f"sweep.{key}[{i}]")
    for key, methods in (("methods", sweep["methods"]),
                         ("curve.methods", curve.get("methods", [])),
                         ("baselines.methods", baselines.get("methods", [])),
                         ("distribution_ablation.methods", ablation.get("methods", [])),
                         ("step_matched.methods", matched.get("methods", [])),
                         ("quick.methods", quick.get("methods") or []),
                         ("time.methods", sweep.get("time", {}).get("methods", []))):
        for i, m in enumerate(methods):
            if m not in METHODS:
                raise config_error(f"unknown method '{m}'; valid: {', '.join(METHODS)}",
                                   source, f"sweep.{key}[{i}]")
            if key in ("curve.methods", "distribution_ablation.methods",
                       "step_matched.methods") and m not in swept:
                raise config_error(f"method '{m}' is in neither sweep.methods nor "
                                   "sweep.baselines.methods", source, f"sweep.{key}[{i}]")
    dists = [("accuracy.distribution", sweep.get("accuracy", {}).get("distribution")),
             ("distribution_ablation.distribution", ablation.get("distribution"))]
    dists += [(f"time.distributions[{i}]", x)
              for i, x in enumerate(sweep.get("time", {}).get("distributions", []))]
    gpus = [("accuracy.gpus", sweep.get("accuracy", {}).get("gpus"))]
    gpus += [(f"time.gpus[{i}]", x) for i, x in enumerate(sweep.get("time", {}).get("gpus", []))]
    for key, x in dists:
        if x is not None and x not in DISTRIBUTIONS:
            raise config_error(f"unknown distribution '{x}'; valid: {', '.join(DISTRIBUTIONS)}",
                               source, f"sweep.{key}")
    for key, x in gpus:
        if x is not None and (not isinstance(x, int) or x <= 0):
            raise config_error(f"gpus must be a positive integer, got {x!r}", source, f"sweep.{key}")
    for name in cfg["models"]:
        gbs, where = model_train_value(cfg, name, "global_batch_size")
        if not isinstance(gbs, int) or isinstance(gbs, bool) or gbs < 1:
            continue  # null (per-rank batch_size) or a bad value the train stage names
        for key, x in gpus:
            if isinstance(x, int) and x > 0 and gbs % x:
                raise config_error(f"global_batch_size {gbs} does not split evenly over "
                                   f"sweep.{key} = {x} GPUs; use a multiple of every GPU count",
                                   source, where)
    for name in cfg["models"]:  # multi-node layout and FSDP against the sweep's GPU counts
        per, where = model_train_value(cfg, name, "gpus_per_node")
        fsdp, fsdp_where = model_train_value(cfg, name, "fsdp")
        for key, x in gpus:
            if not isinstance(x, int) or x <= 0:
                continue
            if isinstance(per, int) and not isinstance(per, bool) and 0 < per < x and x % per:
                raise config_error(f"sweep.{key} = {x} GPUs do not split evenly into nodes of "
                                   f"gpus_per_node = {per}", source, where)
            if fsdp is True and x == 1:
                raise config_error(f"fsdp: true needs at least 2 GPUs, but sweep.{key} trains "
                                   f"model '{name}' on 1; set fsdp: false or use 2 or more GPUs",
                                   source, fsdp_where)
    for name in cfg["models"]:
        keep, where = model_train_value(cfg, name, "keep_model")
        if keep is False:
            raise config_error("keep_model: false would leave the evaluated runs without a "
                               "model; the workflow sets it for the runs that are only timed "
                               "(remove the key)", source, where)
    trunc = (cfg.get("train") or {}).get("truncation")
    if trunc is not None and trunc not in POLICIES:
        raise config_error(f"unknown truncation policy '{trunc}'; valid: {', '.join(POLICIES)}",
                           source, "train.truncation")
    t_epochs = sweep.get("time", {}).get("epochs")
    acc = sweep.get("accuracy", {})
    if acc.get("fuse_seeds") and acc.get("gpus") != 1:
        raise config_error(f"sweep.accuracy.fuse_seeds runs a run's seeds in one plain python "
                           f"process, which needs sweep.accuracy.gpus: 1 (it is "
                           f"{acc.get('gpus')}); set fuse_seeds: false", source,
                           "sweep.accuracy.fuse_seeds")
    acc_dists = [acc.get("distribution")] + ([ablation["distribution"]] if ablation else [])
    shared = [d for d in acc_dists if d in sweep["time"].get("distributions", [])]
    if t_epochs is not None and acc.get("gpus") in sweep["time"].get("gpus", []) and shared:
        raise config_error(f"sweep.time.epochs = {t_epochs}, but the time sweep includes the "
                           f"accuracy runs' {acc['gpus']} GPU {shared[0]} runs, which "
                           "train the accuracy recipe; drop sweep.time.epochs or leave that GPU "
                           "count or distribution out of the time sweep", source, "sweep.time.epochs")
    for i, m in enumerate(sweep.get("time", {}).get("models", []) or []):
        if m not in cfg["models"]:
            raise config_error(f"time-sweep model '{m}' is not defined under models; defined: "
                               f"{', '.join(cfg['models'])}", source, f"sweep.time.models[{i}]")
    k = cfg.get("cluster", {}).get("k")
    for name, d in cfg["datasets"].items():
        n = d.get("n")
        if k is not None and n is not None and k > n:
            raise config_error(f"cluster.k = {k} is larger than the pool size n = {n}",
                               source, f"datasets.{name}.n")
        if k is not None and d.get("source") == "jsonl" and d.get("path") and Path(d["path"]).is_file():
            # Counted at check time (stops at k): the rule graph stays as it is, so
            # prepare_data does not depend on cluster.k.
            have = count_records(d["path"], stop=k)
            if have < k:
                raise config_error(f"cluster.k = {k} is larger than the pool of dataset '{name}': "
                                   f"{d['path']} holds {have} records", source, "cluster.k")
    check_shards(cfg, source)
    check_practice(cfg, source)
    for name, m in cfg["models"].items():
        if m.get("source") == "path" and not Path(m.get("path", "")).exists():
            raise config_error(f"model path '{m.get('path')}' does not exist", source,
                               f"models.{name}.path")
        if m.get("source") == "hub" and not cfg.get("allow_downloads", False):
            local = m.get("path")
            if not (local and Path(local).exists()):
                # Allowed for dry runs (-n): the base_model rule raises before downloading.
                pass
    tok = cfg.get("tokenizer", {}) or {}
    if tok.get("source") == "path" and not Path(tok.get("path") or "").exists():
        raise config_error(f"tokenizer path '{tok.get('path')}' does not exist", source,
                           "tokenizer.path")
    for name, d in cfg["datasets"].items():
        if d.get("source") == "jsonl" and not Path(d.get("path") or "").is_file():
            raise config_error(f"dataset file '{d.get('path')}' does not exist", source,
                               f"datasets.{name}.path")
    named = cfg.get("tasks", {}).get("lm_eval_tasks")
    if not named:
        from clusterft.tasks.registry import TASKS

        for i, t in enumerate(cfg.get("tasks", {}).get("only", []) or []):
            if t not in TASKS:
                raise config_error(f"benchmark task '{t}' is not defined; defined: "
                                   f"{', '.join(TASKS)}", source, f"tasks.only[{i}]")
        for name in cfg["datasets"]:
            if not tasks_for(cfg, name):
                raise config_error(f"no benchmark task evaluates dataset '{name}' (tasks come from "
                                   "the skills/pycode/icd10 generators, or set "
                                   f"tasks.lm_eval_tasks); defined tasks: {', '.join(TASKS)}",
                                   source, f"datasets.{name}")
    # Last: a config whose files and sizes are right can still ask for a method it cannot feed.
    check_method_inputs(cfg, source)
