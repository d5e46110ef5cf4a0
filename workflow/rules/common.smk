# Glue shared by every rule file. The package on the path; the config merged and checked
# (clusterft.plan.config.prepare); the sweep (clusterft.plan.sweep); the input and param
# functions (clusterft.plan.inputs); the wildcard constraints.
import os
from pathlib import Path

# The package lives in workflow/clusterft; make it importable by every job,
# installed (pip install -e .) or not, with or without --sdm conda.
# Jobs inherit this environment; the venv's bin (torchrun) goes first on PATH too.
PKG_DIR = str(Path(workflow.basedir) / "workflow")
_env = dict(os.environ)
os.environ.update(
    {
        "PYTHONPATH": os.pathsep.join(
            p for p in (PKG_DIR, _env.get("PYTHONPATH")) if p
        ),
        "PATH": os.pathsep.join(
            (str(Path(sys.executable).parent), _env.get("PATH", ""))
        ),
    }
)
if PKG_DIR not in sys.path:
    sys.path.insert(0, PKG_DIR)

from clusterft.pipeline.names import DIST_PATTERN, FEATURE_KINDS, METHODS
from clusterft.plan.config import prepare
from clusterft.plan.inputs import Inputs
from clusterft.plan.sweep import RUN, SELECTION, Sweep
from clusterft.tools.cost import runtime_estimator

# Errors name the config file, the line and the field (the last --configfile, which sets
# most keys; config/config.yaml when none is given), or `--config` for a value an override
# set. prepare() types nested --config values by the schema, checks the config, sets the
# schema's defaults into `config` and returns CFG: every value the rules decide by, with
# the stage modules' DEFAULTS under it. Params hand the jobs `config`'s own sections.
CONFIG_SOURCE = str(
    (workflow.config_settings.configfiles or ["config/config.yaml"])[-1]
)
CFG = prepare(
    config,
    source=CONFIG_SOURCE,
    overrides=workflow.config_settings.config,
    warn=lambda msg: print(f"Warning: {msg}", file=sys.stderr),
)
# The sweep's runs, paths and report inputs; every rule's input and param functions
# (JOBS.<function>, grouped by rule file in clusterft.plan.inputs), with the cost model
# that GPU jobs' runtimes follow (clusterft.plan.resources).
PLAN = Sweep(CFG)
# The CPU kernel of float32 linear layers (clusterft.modeling.cpu_matmul): the jobs, local
# or submitted, inherit this environment and read it when they load a model.
os.environ.update({"CLUSTERFT_CPU_MATMUL": config["cpu_matmul"]})
JOBS = Inputs(config, PLAN, cost=runtime_estimator)

ENV = "../../envs/clusterft.yaml"
DATASETS = PLAN.datasets
MODELS = PLAN.models
SEEDS = PLAN.seeds
USE_GPU = JOBS.use_gpu
# sweep.accuracy.fuse_seeds: the seeds of a one-GPU accuracy run train in one job
# (train_seeds) and evaluate in one job (evaluate_seeds), one after the other in one
# process, sharing its start-up; logs and benchmarks go to <run>/s<seed>+<seed>+... .
FUSE_SEEDS = PLAN.fuse_seeds
RUN_SEEDS = PLAN.run_seeds
section = JOBS.section
task_item_dirs = JOBS.task_item_dirs
eval_tasks = JOBS.eval_tasks
# The download rule's outputs (download.smk); jobs that read what it fetched take
# `download_manifest` (empty when the config reads nothing from outside) as an input and
# the mirror (None then) as a param.
DOWNLOAD_MANIFEST = "results/download/manifest.json"
DOWNLOAD_MIRROR = "results/download/datasets"
download_manifest = JOBS.download_manifest
distribution_of = JOBS.train_distribution


def per_seed(pattern):
    """`pattern` (with a {seed} wildcard among others) for every seed of the config."""
    return [pattern.replace("{seed}", str(s)) for s in SEEDS]


wildcard_constraints:
    dataset="|".join(DATASETS),
    model="|".join(MODELS),
    method="|".join(METHODS),
    budget=r"[0-9]+(\.[0-9]+)?",
    gpus=r"[1-9][0-9]*",
    dist=DIST_PATTERN,
    seed=r"[0-9]+",
    kind="|".join(FEATURE_KINDS),
