"""The package's command line runs every stage on its own, on real small inputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clusterft", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=600)


def test_stages_chain_from_the_command_line(tmp_path: Path, tiny_model_dir: Path) -> None:
    (tmp_path / "data.yaml").write_text("items_per_task: 20\n")
    out = cli("prepare-data", "--dataset", "skills", "--n", "96", "--config", "data.yaml",
              "--out-pool", "pool.jsonl", "--out-labels", "labels.parquet",
              "--out-items", "bench", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    pool = [json.loads(line) for line in (tmp_path / "pool.jsonl").read_text().splitlines()]
    assert len(pool) == 96 and sorted(p.name for p in (tmp_path / "bench").glob("*.jsonl"))

    (tmp_path / "score.yaml").write_text("dim: 16\nwarmup_steps: 2\nbatch_size: 16\n")
    out = cli("score", "--model", str(tiny_model_dir), "--pool", "pool.jsonl", "--config",
              "score.yaml", "--out-features", "f.npy", "--out-scores", "s.parquet", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    feats = np.load(tmp_path / "f.npy")
    assert feats.shape == (96, 16)
    np.testing.assert_allclose(np.linalg.norm(feats, axis=1), 1.0, rtol=1e-5)

    out = cli("cluster", "--features", "f.npy", "--scores", "s.parquet", "--k", "4",
              "--out-clusters", "c.parquet", "--out-centroids", "c.npy", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    clusters = pd.read_parquet(tmp_path / "c.parquet")
    assert set(clusters["cluster"]) == {0, 1, 2, 3}

    out = cli("select", "--clusters", "c.parquet", "--scores", "s.parquet", "--method", "cluster",
              "--budget", "0.25", "--out-selection", "sel.parquet", "--out-summary", "sel.json",
              cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    sel = pd.read_parquet(tmp_path / "sel.parquet")
    assert len(sel) == 24 and set(sel["cluster"]) == {0, 1, 2, 3}


def test_baselines_from_the_command_line(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Every feature kind and target-aware method a user can run without the workflow."""
    (tmp_path / "data.yaml").write_text("items_per_task: 20\nval_per_task: 4\n")
    assert cli("prepare-data", "--dataset", "skills", "--n", "64", "--config", "data.yaml",
               "--out-pool", "pool.jsonl", "--out-labels", "labels.parquet",
               "--out-items", "bench", cwd=tmp_path).returncode == 0
    tasks = sorted(p.name.removesuffix(".val.jsonl") for p in (tmp_path / "bench").glob("*.val.jsonl"))
    assert tasks
    (tmp_path / "score.yaml").write_text("dim: 8\nwarmup_steps: 4\nloss_points: 3\n")
    out = cli("score", "--model", str(tiny_model_dir), "--pool", "pool.jsonl", "--config",
              "score.yaml", "--out-features", "g.npy", "--out-scores", "g.parquet",
              "--out-trajectories", "traj.npy", "--tasks", *tasks, "--items", "bench",
              "--out-targets", "gt.npy", "--out-target-ids", "gt.parquet", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert np.load(tmp_path / "traj.npy").shape == (64, 3)
    assert np.load(tmp_path / "gt.npy").shape == (len(pd.read_parquet(tmp_path / "gt.parquet")), 8)
    out = cli("loss-features", "--trajectories", "traj.npy", "--scores", "g.parquet",
              "--out-features", "l.npy", "--out-scores", "l.parquet", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    out = cli("features", "--kind", "embedding", "--model", str(tiny_model_dir), "--pool",
              "pool.jsonl", "--out-features", "e.npy", "--out-scores", "e.parquet", "--tasks",
              *tasks, "--items", "bench", "--out-targets", "et.npy", "--out-target-ids",
              "et.parquet", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    for f, s in (("l.npy", "l.parquet"), ("e.npy", "e.parquet"), ("g.npy", "g.parquet")):
        out = cli("cluster", "--features", f, "--scores", s, "--k", "3", "--out-clusters",
                  f"c-{f}.parquet", "--out-centroids", f"c-{f}.npy", cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
    runs = {"s2l": ["--clusters", "c-l.npy.parquet", "--scores", "l.parquet"],
            "oracle": ["--clusters", "c-l.npy.parquet", "--scores", "l.parquet", "--labels",
                       "labels.parquet"],
            "rs2": ["--clusters", "c-l.npy.parquet", "--scores", "l.parquet", "--epochs", "2"],
            "less": ["--clusters", "c-g.npy.parquet", "--scores", "g.parquet", "--features",
                     "g.npy", "--targets", "gt.npy", "--target-ids", "gt.parquet"],
            "rds": ["--clusters", "c-e.npy.parquet", "--scores", "e.parquet", "--features",
                    "e.npy", "--targets", "et.npy", "--target-ids", "et.parquet"]}
    for method, args in runs.items():
        out = cli("select", "--method", method, "--budget", "0.25", *args, "--out-selection",
                  f"{method}.parquet", "--out-summary", f"{method}.json", cwd=tmp_path)
        assert out.returncode == 0, (method, out.stderr[-3000:])
        sel = pd.read_parquet(tmp_path / f"{method}.parquet")
        assert len(sel) == (32 if method == "rs2" else 16), method
    # LESS with the embedding run's targets: files of two runs, refused before any work
    out = cli("select", "--method", "less", "--budget", "0.25", *runs["less"][:6], "--targets",
              "et.npy", "--target-ids", "et.parquet", "--out-selection", "x.parquet",
              "--out-summary", "x.json", cwd=tmp_path)
    assert out.returncode == 2 and "do not belong together" in out.stderr, out.stderr[-2000:]


def test_bad_input_gives_a_clear_error_and_exit_code(tmp_path: Path) -> None:
    (tmp_path / "c.parquet").write_bytes(b"")
    out = cli("select", "--clusters", "missing.parquet", "--scores", "s.parquet", "--method",
              "cluster", "--budget", "0.3", "--out-selection", "x.parquet", "--out-summary",
              "x.json", cwd=tmp_path)
    assert out.returncode == 2
    assert "missing.parquet" in out.stderr and "Traceback" not in out.stderr
    out = cli("select", "--clusters", "c.parquet", "--scores", "s.parquet", "--method", "cluster",
              "--budget", "1.5", "--out-selection", "x.parquet", "--out-summary", "x.json",
              cwd=tmp_path)
    assert out.returncode != 0 and "budget" in out.stderr


def test_help_lists_every_stage(tmp_path: Path) -> None:
    out = cli("--help", cwd=tmp_path)
    for stage in ("prepare-data", "corpus", "tokenizer", "base-model", "score", "features",
                  "loss-features", "cluster", "select", "train", "evaluate", "report"):
        assert stage in out.stdout


def test_score_checks_trains_length_policy_from_the_command_line(tmp_path: Path,
                                                                  tiny_model_dir: Path) -> None:
    pool = Path(__file__).resolve().parent / "bad_inputs" / "data" / "too_long.jsonl"
    args = ("score", "--model", str(tiny_model_dir), "--pool", str(pool), "--out-features",
            "f.npy", "--out-scores", "s.parquet", "--train-max-length", "48")
    out = cli(*args, "--truncation", "error", cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"{pool}, line 2" in out.stderr and "'ex-1'" in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "f.npy").exists()


# ------------------------------------------------------------------ help, flags, parsing

def _subparsers(parser):
    import argparse

    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def _parsers() -> dict:
    """Every parser a user meets: `clusterft`, each `clusterft STAGE`, and the stages' and
    tools' own (`python -m clusterft.stages.train`, ...)."""
    from clusterft.cli import build_parser
    from clusterft.stages import train
    from clusterft.tools import compare, cost

    top = build_parser()
    out = {"clusterft": top}
    out.update({f"clusterft {k}": v for k, v in _subparsers(top).choices.items()})
    out.update({m.__name__: m.build_parser() for m in (train, cost, compare)})
    return out


def _flags(parser) -> list[str]:
    return [o for a in parser._actions for o in a.option_strings if o not in ("-h", "--help")]


def test_each_stage_help_shows_its_real_flags(capsys) -> None:
    from clusterft.cli import main
    from clusterft.stages import train
    from clusterft.tools import compare, cost

    parsers = _parsers()
    stages = [k.split()[1] for k in parsers if k.startswith("clusterft ")]
    assert {"prepare-data", "train", "cost", "compare", "evaluate", "report"} <= set(stages)
    for name in stages:
        with pytest.raises(SystemExit) as e:
            main([name, "--help"])
        assert e.value.code == 0
        text = capsys.readouterr().out
        assert f"usage: clusterft {name}" in text
        for flag in _flags(parsers[f"clusterft {name}"]):
            assert flag in text, (name, flag)
    # the stages with a parser of their own: the same flags (one set), the same help texts
    for module in (train, cost, compare):
        name = module.__name__.rsplit(".", 1)[-1]
        own, ours = module.build_parser(), parsers[f"clusterft {name}"]
        assert _flags(own) == _flags(ours)
        assert [a.help for a in own._actions] == [a.help for a in ours._actions]


def test_clusterft_train_help_from_the_command_line(tmp_path: Path) -> None:
    out = cli("train", "--help", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    for flag in ("--distribution", "--selection", "--metrics", "--threads", "balanced"):
        assert flag in out.stdout, flag


def test_every_flag_has_a_help_text_and_no_parser_takes_abbreviations() -> None:
    for name, parser in _parsers().items():
        assert parser.allow_abbrev is False, name
        for action in parser._actions:
            assert action.help and action.help.strip(), (name, action.dest)
            sub = getattr(action, "_choices_actions", [])
            for choice in sub:
                assert choice.help and choice.help.strip(), (name, choice.dest)


@pytest.mark.parametrize("argv, flag", [
    (["select", "--clusters", "c.parquet", "--scores", "s.parquet", "--method", "less",
      "--out-selection", "x.parquet", "--out-summary", "x.json", "--feature", "f.npy"],
     "--feature"),
    (["train", "--model", "m", "--pool", "p", "--selection", "s", "--out", "o", "--metrics",
      "m.json", "--distrib", "balanced"], "--distrib"),
    (["cost", "--config", "c.yaml", "--mf", "0.5"], "--mf"),
    (["compare", "a", "b", "--js", "x.json"], "--js"),
])
def test_an_abbreviated_flag_is_refused(argv, flag, capsys) -> None:
    from clusterft.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert flag in capsys.readouterr().err


def test_the_stages_own_parsers_refuse_abbreviations(capsys) -> None:
    from clusterft.stages import train

    with pytest.raises(SystemExit) as e:
        train.main(["--model", "m", "--pool", "p", "--selection", "s", "--out", "o",
                    "--metrics", "m.json", "--thread", "2"])
    assert e.value.code == 2 and "--thread" in capsys.readouterr().err


def test_prepare_data_sources_are_the_codes_own(capsys) -> None:
    from clusterft.cli import main
    from clusterft.stages.data.prepare import DEFAULTS

    parser = _parsers()["clusterft prepare-data"]
    source = next(a for a in parser._actions if "--source" in a.option_strings)
    assert tuple(source.choices) == tuple(DEFAULTS)
    assert "hub" not in source.help
    with pytest.raises(SystemExit) as e:
        main(["prepare-data", "--dataset", "x", "--source", "hub", "--out-pool", "p.jsonl",
              "--out-labels", "l.parquet", "--out-items", "items"])
    assert e.value.code == 2 and "invalid choice: 'hub'" in capsys.readouterr().err


def test_every_parser_in_the_package_refuses_abbreviations_and_explains_its_flags():
    """Read from the source, so parsers built inside a module's own main() count too."""
    import ast
    from pathlib import Path

    pkg = Path(__file__).resolve().parents[1] / "workflow" / "clusterft"
    bad = []
    for f in pkg.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute | ast.Name):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
            kws = {k.arg: k.value for k in node.keywords}
            if name in ("ArgumentParser", "add_parser"):
                ok = isinstance(kws.get("allow_abbrev"), ast.Constant) and kws["allow_abbrev"].value is False
                ok = ok or None in kws  # **common kwargs: checked at run time by the tests above
                if not ok:
                    bad.append(f"{f.relative_to(pkg)}:{node.lineno} {name} without allow_abbrev=False")
            elif name == "add_argument" and "help" not in kws and None not in kws:
                bad.append(f"{f.relative_to(pkg)}:{node.lineno} add_argument without help")
    assert not bad, "\n".join(bad)
