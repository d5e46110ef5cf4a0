"""report.py on synthetic result files: table values, ratios, plots, findings verdicts."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from clusterft.pipeline.errors import InputError
from clusterft.stages.report import (DEFAULTS, accuracy_table, claims_markdown, findings_text,
                                     imbalance, load_runs, run_report, time_table, to_markdown)

TASKS = ["mc_task", "gen_task"]
SPECS = {"mc_task": {"name": "mc_task", "chance": 0.25},
         "gen_task": {"name": "gen_task", "chance": 0.0}}


def _eval(path: Path, values: dict[str, float]) -> str:
    tasks = {t: {"metric": "acc", "value": v, "stderr": 0.01, "n": 200} for t, v in values.items()}
    path.write_text(json.dumps({"tasks": tasks, "average": float(np.mean(list(values.values())))}))
    return str(path)


def _train(path: Path, wall: float, tokens: int, steps: int, per_rank: list, epochs: int = 3,
           precision: str = "fp32", cpu: str = "Test CPU") -> str:
    path.write_text(json.dumps({"wall_time_s": wall, "steps": steps, "epochs": epochs, "tokens": tokens,
                                "precision": precision, "hardware": {"cpu": cpu},
                                "examples": 100, "world_size": len(per_rank[0]),
                                "distribution": "balanced", "per_rank_tokens_per_step": per_rank,
                                "final_loss": 1.0, "loss_curve": [2.0, 1.0]}))
    return str(path)


def _items(path: Path, values: dict[str, float], n: int = 200) -> str:
    """Per-item results matching `values`: the first round(v * n) items of a task right."""
    rows = [{"task": t, "doc_id": i, "item": f"{t}-{i}", "value": float(i < round(v * n))}
            for t, v in values.items() for i in range(n)]
    pd.DataFrame(rows).to_parquet(path)
    return str(path)


def make_runs(tmp: Path, acc: dict[str, tuple[float, float]], seeds=(0, 1),
              items: bool = False) -> list[dict]:
    """Runs of one dataset/model. acc[method@budget] = (mc value, gen value) for seed 0;
    seed s adds 0.02 * s to both. Time runs: cluster 31% at 2/4 GPUs x balanced/random.
    `items`: per-item results too (the paired comparisons' input)."""
    runs = []
    for key, (mc, gen) in acc.items():
        method, budget = key.split("@")
        for s in seeds:
            d = {"mc_task": mc + 0.02 * s, "gen_task": gen + 0.02 * s}
            ev = _eval(tmp / f"ev_{method}_{budget}_{s}.json", d)
            rec = {"dataset": "ds", "model": "small", "method": method, "budget": float(budget),
                   "gpus": 2, "distribution": "balanced", "seed": s, "eval_json": ev}
            if items:
                rec["items"] = _items(tmp / f"it_{method}_{budget}_{s}.parquet", d)
            if method == "base":
                rec.update(gpus=None, distribution=None, train_metrics_json=None)
            else:
                wall = (100.0 if method == "full" else 100.0 * float(budget)) + s
                rec["train_metrics_json"] = _train(tmp / f"tm_{method}_{budget}_{s}.json", wall,
                                                   int(1000 * float(budget)), 10,
                                                   [[10, 30], [20, 20]])
            runs.append(rec)
    for gpus in (2, 4):
        for dist, wall, per_rank in (("balanced", 30.0, [[20] * gpus]),
                                     ("random", 40.0, [[10] * (gpus - 1) + [30]])):
            if gpus == 2 and dist == "balanced":
                continue  # that one is the accuracy run above
            runs.append({"dataset": "ds", "model": "small", "method": "cluster", "budget": 0.31,
                         "gpus": gpus, "distribution": dist, "seed": 0, "eval_json": "",
                         "train_metrics_json": _train(tmp / f"tm_t_{gpus}_{dist}.json",
                                                      wall + gpus, 310, 5, per_rank)})
    return runs


GOOD = {"base@0": (0.25, 0.0), "full@1.0": (0.60, 0.40), "random@0.31": (0.45, 0.20),
        "cluster@0.31": (0.59, 0.40), "random@0.5": (0.50, 0.30), "cluster@0.5": (0.55, 0.35)}


def test_accuracy_table_means_and_std(tmp_path):
    runs = make_runs(tmp_path, GOOD)
    df, tasks = load_runs(runs)
    assert tasks == TASKS
    acc = accuracy_table(df, tasks)
    assert len(acc) == len(GOOD)
    assert list(acc["method"].iloc[:2]) == ["base", "full"]  # base, full, random, cluster
    r = acc[(acc["method"] == "cluster") & (acc["fraction"] == 0.31)].iloc[0]
    seed_avgs = [np.mean([0.59 + 0.02 * s, 0.40 + 0.02 * s]) for s in (0, 1)]
    assert r["n_seeds"] == 2 and r["n_runs"] == 2
    assert r["average_mean"] == pytest.approx(np.mean(seed_avgs))
    assert r["average_std"] == pytest.approx(np.std(seed_avgs, ddof=1))
    assert r["mc_task_mean"] == pytest.approx(0.60)
    assert r["gen_task_std"] == pytest.approx(np.std([0.40, 0.42], ddof=1))
    base = acc[acc["method"] == "base"].iloc[0]
    assert base["fraction"] == 0.0 and base["average_mean"] == pytest.approx(0.135)


def test_same_seed_runs_count_once(tmp_path):
    runs = make_runs(tmp_path, {"full@1.0": (0.6, 0.4)}, seeds=(0,))
    extra = dict(runs[0], gpus=4, eval_json=_eval(tmp_path / "x.json",
                                                   {"mc_task": 0.8, "gen_task": 0.6}))
    df, tasks = load_runs(runs + [extra])
    r = accuracy_table(df, tasks).iloc[0]
    assert r["n_seeds"] == 1 and r["n_runs"] == 2
    assert r["average_mean"] == pytest.approx((0.5 + 0.7) / 2)
    assert math.isnan(r["average_std"])


def test_time_table_ratio_and_imbalance(tmp_path):
    df, _ = load_runs(make_runs(tmp_path, GOOD))
    tt = time_table(df)
    full = tt[(tt["method"] == "full") & (tt["gpus"] == 2)].iloc[0]
    assert full["wall_time_s_mean"] == pytest.approx(100.5)
    assert full["ratio_to_full"] == pytest.approx(1.0)
    c = tt[(tt["method"] == "cluster") & (tt["fraction"] == 0.31) & (tt["gpus"] == 2)
           & (tt["distribution"] == "balanced")].iloc[0]
    assert c["wall_time_s_mean"] == pytest.approx(31.5)
    assert c["ratio_to_full"] == pytest.approx(31.5 / 100.5)
    assert c["imbalance_mean"] == pytest.approx((30 / 20 + 1.0) / 2)
    r4 = tt[(tt["gpus"] == 4) & (tt["distribution"] == "random")].iloc[0]
    assert r4["imbalance_mean"] == pytest.approx(30 / 15)
    assert math.isnan(r4["ratio_to_full"])  # no full run at 4 GPUs
    assert not (tt["method"] == "base").any()


def test_time_ratio_only_against_full_runs_of_the_same_epochs(tmp_path):
    """Time-only runs may train fewer epochs (sweep.time.epochs): a 1-epoch cluster run is
    compared with the 1-epoch full run, never with the 3-epoch one at the same GPUs."""
    runs = make_runs(tmp_path, GOOD)  # 3 epochs
    for method, budget, wall in (("cluster", 0.31, 12.0), ("full", 1.0, 30.0)):
        runs.append({"dataset": "ds", "model": "small", "method": method, "budget": budget,
                     "gpus": 2, "distribution": "balanced", "seed": 0, "eval_json": "",
                     "train_metrics_json": _train(tmp_path / f"tm_e1_{method}.json", wall, 100, 4,
                                                  [[20, 20]], epochs=1)})
    df, tasks = load_runs(runs)
    tt = time_table(df)
    sel = (tt["method"] == "cluster") & (tt["gpus"] == 2) & (tt["distribution"] == "balanced")
    one, three = tt[sel & (tt["epochs"] == "1")].iloc[0], tt[sel & (tt["epochs"] == "3")].iloc[0]
    assert one["ratio_to_full"] == pytest.approx(12.0 / 30.0) and one["n_seeds"] == 1
    assert three["ratio_to_full"] == pytest.approx(31.5 / 100.5) and three["n_seeds"] == 2
    text = findings_text(accuracy_table(df, tasks), time_table(df))
    tred = [ln for ln in text.splitlines() if ln.startswith("- **training time cut**")]
    assert any("12.0 s vs full 30.0 s = 0.400 of full (2 GPU balanced, 1 epoch," in ln
               for ln in tred), tred
    assert any("31.5 s vs full 100.5 s = 0.313 of full (2 GPU balanced, 3 epochs," in ln
               for ln in tred), tred
    from clusterft.stages.report import time_markdown

    header = time_markdown(tt).splitlines()[0]
    assert "| fraction | epochs |" in header


def test_imbalance():
    assert imbalance([[5, 5, 5], [0, 0, 0]]) == 1.0
    assert imbalance([[1, 3]]) == pytest.approx(1.5)
    assert math.isnan(imbalance([]))


CLAIM_ROW = re.compile(r"^- \*\*(.+?)\*\*: \*\*(.+?)\*\* — ")


def _claims_md_rows(md: str) -> list[tuple[str, str]]:
    """(claim, verdict) of every table row of claims.md (cells split on unescaped '|')."""
    out = []
    for ln in md.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", ln)[1:-1]]
        if len(cells) == 7 and cells[0] not in ("claim", "---"):
            out.append((cells[0], cells[6]))
    return out


@pytest.mark.parametrize("case", ["good", "bad"])
def test_findings_and_claims_say_the_same_verdicts(tmp_path, case):
    """One decider: on one simulated run (per-item results, time runs), every claim's
    verdict in findings.md is the verdict claims.md gives it, word for word (the rehearsal
    had 'not reproduced: within seed noise' in one file and 'inconclusive' in the other)."""
    acc = dict(GOOD, **{"base@0": (0.25, 0.0)})
    if case == "bad":
        acc["cluster@0.31"] = (0.30, 0.15)  # cluster below random
    runs = make_runs(tmp_path, acc, seeds=(0, 1, 2), items=True)
    run_report(runs, tmp_path / "tables", tmp_path / "plots", SPECS, {"n_boot": 300})
    findings = (tmp_path / "tables" / "findings.md").read_text()
    claims = _claims_md_rows((tmp_path / "tables" / "claims.md").read_text())
    bullets = [m.groups() for ln in findings.splitlines() if (m := CLAIM_ROW.match(ln))]
    assert len(claims) >= 7 and sorted(bullets) == sorted(claims)
    verdicts = dict(bullets)
    assert verdicts["better than usual selection"] == (
        "not reproduced (the other is better)" if case == "bad" else "reproduced")
    assert verdicts["accuracy kept at 31% of the data"] == (
        "not reproduced" if case == "bad" else "reproduced")
    # 31.5 s of 100.5 s = 0.313 of full: above the paper's 0.304
    assert verdicts["training time cut"] == "not reproduced"
    assert "Seed means of the average accuracy" in findings


def test_findings_missing_runs_say_so(tmp_path):
    df, tasks = load_runs(make_runs(tmp_path, {"full@1.0": (0.6, 0.4)}))
    text = findings_text(accuracy_table(df, tasks), time_table(df))
    # near-full and cluster>random need cluster runs (and per-item results); time reduction
    # needs cluster and full at the same GPUs/distribution (the time runs have no full
    # counterpart); the positive control an oracle run; balanced vs random has its pairs at
    # 4 GPUs.
    assert text.count("**not evaluated") == 4
    speed = [ln for ln in text.splitlines() if ln.startswith("- **faster than")]
    assert speed and not any("not evaluated" in ln for ln in speed)


def test_run_report_writes_everything(tmp_path):
    runs = make_runs(tmp_path, GOOD)
    pd.DataFrame(runs).to_csv(tmp_path / "runs.csv", index=False)
    out = run_report(tmp_path / "runs.csv", tmp_path / "tables", tmp_path / "plots", SPECS)
    for name in ("accuracy_vs_data.csv", "accuracy_vs_data.md", "time.csv", "time.md",
                 "findings.md"):
        assert (tmp_path / "tables" / name).stat().st_size > 0
    acc = pd.read_csv(tmp_path / "tables" / "accuracy_vs_data.csv")
    assert {"average_mean", "average_std", "mc_task_mean", "fraction", "n_seeds"} <= set(acc)
    md = (tmp_path / "tables" / "accuracy_vs_data.md").read_text().splitlines()
    assert len(md) == 2 + len(GOOD)
    row = next(ln for ln in md if "| cluster | 31% |" in ln)
    mc = [0.59, 0.61]  # cluster 31% mc_task over seeds 0 and 1
    assert f"| {np.mean(mc):.3f} ± {np.std(mc, ddof=1):.3f} |" in row
    import matplotlib.image as mpimg
    for p in out["plots"]:
        assert Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert mpimg.imread(p).shape[0] > 100
    assert sorted(Path(p).name for p in out["plots"]) == ["accuracy_vs_data_ds.png",
                                                         "comparisons_ds.png", "time_ds.png"]
    # without per-item results: no comparisons, yet claims.md and findings.md agree
    assert "**not evaluated**" in (tmp_path / "tables" / "findings.md").read_text()
    assert "| not evaluated |" in (tmp_path / "tables" / "claims.md").read_text()


def test_bad_records_name_the_record_and_field(tmp_path):
    with pytest.raises(InputError, match="run record 0.*field 'seed'"):
        load_runs([{"dataset": "ds", "model": "m", "method": "full"}])
    with pytest.raises(InputError, match="run record 0.*budget"):
        load_runs([{"dataset": "ds", "model": "m", "method": "random", "seed": 0,
                    "budget": 120}])
    df, _ = load_runs([{"dataset": "ds", "model": "m", "method": "random", "seed": 0,
                        "budget": 120, "pool_size": 1200}])
    assert df["fraction"].iloc[0] == pytest.approx(0.1)
    (tmp_path / "e.json").write_text('{"tasks": {"t": {"metric": "acc"}}}')
    with pytest.raises(InputError, match="e.json.*tasks.t.value"):
        load_runs([{"dataset": "ds", "model": "m", "method": "full", "seed": 0,
                    "eval_json": str(tmp_path / "e.json")}])


def test_to_markdown_escapes_and_formats():
    md = to_markdown(pd.DataFrame({"a": ["x|y", "z"], "b": [0.12345, float("nan")]}))
    assert md.splitlines() == ["| a | b |", "| --- | --- |", "| x\\|y | 0.123 |", "| z |  |"]


def test_defaults_documented():
    assert {"claim_budget", "near_full_margin", "min_se"} <= set(DEFAULTS)
    assert "near_full_tolerance" not in DEFAULTS  # superseded by the non-inferiority margin


def test_findings_count_tasks_where_full_clearly_beats_base(tmp_path):
    # n = 200 items: 2 SE of 0.30 vs 0.60 is ~0.095 (clear), of 0.00 vs 0.01 ~0.014 (not clear).
    runs = make_runs(tmp_path, {"base@0": (0.30, 0.00), "full@1.0": (0.60, 0.01)}, seeds=(0,))
    df, tasks = load_runs(runs)
    acc = accuracy_table(df, tasks)
    text = findings_text(acc, time_table(df), tasks=tasks)
    line = next(ln for ln in text.splitlines() if ln.startswith("- **small**"))
    assert "1 of 2 tasks" in line and "gen_task (0.000 → 0.010)" in line
    assert "mc_task" not in line.split("not clearly")[1]
    sub = tmp_path / "b"
    sub.mkdir()
    runs = make_runs(sub, {"base@0": (0.30, 0.00), "full@1.0": (0.60, 0.20)}, seeds=(0,))
    df, tasks = load_runs(runs)
    text = findings_text(accuracy_table(df, tasks), time_table(df), tasks=tasks)
    assert "- **small**: 2 of 2 tasks." in text


def test_standard_error_is_at_least_min_se(tmp_path):
    """accuracy_vs_data's cross-run standard error is the seed SE, never below report.min_se
    (the spread between CPU kinds): two seeds that agree by chance do not make a cell
    precise. Paired comparisons of one machine's runs are not floored (test_verdict), and
    claims.md says so."""
    same = {"full@1.0": (0.60, 0.40), "random@0.31": (0.45, 0.20), "cluster@0.31": (0.49, 0.23)}
    runs = make_runs(tmp_path, same)
    df, tasks = load_runs(runs)
    acc = accuracy_table(df, tasks, {"min_se": 0.0})
    r = acc[acc["method"] == "cluster"].iloc[0]
    assert r["average_se"] == pytest.approx(r["average_std"] / math.sqrt(2))  # seed SE ~0.014
    acc2 = accuracy_table(df, tasks, {"min_se": 0.02})
    assert (acc2["average_se"] >= 0.02).all()
    sub = tmp_path / "one"
    sub.mkdir()
    df1, _ = load_runs(make_runs(sub, same, seeds=(0,)))
    one = accuracy_table(df1, tasks)
    assert one["average_se"].isna().all()  # one seed: no noise estimate, not the floor
    md = claims_markdown(pd.DataFrame(columns=["claim"]), dict(DEFAULTS))
    assert "`report.min_se` (0.020, the spread between CPU kinds) floors it only where the " \
        "paired runs trained on different CPUs" in md


def test_precision_shown_and_never_mixed_silently(tmp_path):
    runs = make_runs(tmp_path, GOOD)
    df, tasks = load_runs(runs)
    acc = accuracy_table(df, tasks)
    assert set(acc.loc[acc["method"] != "base", "precision"]) == {"fp32"}
    assert "| precision |" in __import__("clusterft.stages.report", fromlist=["x"]).accuracy_markdown(
        acc, tasks).splitlines()[0]
    # one seed of cluster 31% trained in bf16: its row says so, the time table splits it
    rec = next(r for r in runs if r["method"] == "cluster" and r["seed"] == 1
               and r["budget"] == 0.31 and r["eval_json"])
    rec["train_metrics_json"] = _train(tmp_path / "tm_bf16.json", 31.0, 310, 10, [[10, 30]],
                                       precision="bf16", cpu="Other CPU")
    df, tasks = load_runs(runs)
    acc = accuracy_table(df, tasks)
    r = acc[(acc["method"] == "cluster") & (acc["fraction"] == 0.31)].iloc[0]
    assert r["precision"] == "bf16+fp32"
    tt = time_table(df)
    sel = tt[(tt["method"] == "cluster") & (tt["gpus"] == 2) & (tt["distribution"] == "balanced")
             & np.isclose(tt["fraction"], 0.31)]
    assert sorted(sel["precision"]) == ["bf16", "fp32"]
    assert sel.loc[sel["precision"] == "bf16", "ratio_to_full"].isna().all()  # no bf16 full run
    text = findings_text(acc, tt, None, tasks, df)
    tred = [ln for ln in text.splitlines() if ln.startswith("- **training time cut**")]
    assert any("(2 GPU balanced, 3 epochs, fp32, 1 seed)" in ln for ln in tred), tred
    assert not any("bf16" in ln for ln in tred)  # no bf16 full run: no ratio
    cond = text.split("## Run conditions")[1].split("##")[0]
    assert "Training precision: fp32" in cond and "bf16 (1 runs)" in cond and "mixed" in cond
    assert "Other CPU (1 runs)" in cond
