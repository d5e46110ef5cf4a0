"""clusterft.analysis.verdict: skill recovery and label coverage from files, paired comparisons on
per-item results, the power line and the verdict rules, on constructed cases."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from clusterft.analysis import verdict
from clusterft.pipeline.io import write_parquet
from clusterft.analysis.stats import cluster_agreement, minimum_detectable_difference

TASKS = ("t1", "t2", "t3")
CONTROL = "oracle vs random: positive control and power line (diagnosis)"


def items_file(path, p_correct: float, rng, n: int = 200):
    """Per-item results of one run: n items per task, each right with p_correct."""
    rows = [{"task": t, "doc_id": i, "item": f"{t}-{i}", "value": float(rng.random() < p_correct)}
            for t in TASKS for i in range(n)]
    write_parquet(path, pd.DataFrame(rows))
    return str(path)


def runs_frame(tmp_path, accuracy: dict[str, float], seeds=(0, 1, 2), ablation=None,
               n: int = 200, dataset: str = "d", cpu: dict | None = None):
    """Runs of one dataset x model; `base` (the untrained model) is evaluated once, seed 0.
    `cpu`: method -> the CPU its runs trained on (default: one machine for all)."""
    rng = np.random.default_rng(0)
    rows = []
    for method, p in accuracy.items():
        for s in (0,) if method == "base" else seeds:
            frac = {"full": 1.0, "base": 0.0}.get(method, 0.31)
            rows.append({"dataset": dataset, "model": "m", "method": method, "seed": s,
                         "fraction": frac, "distribution": "balanced", "role": "accuracy",
                         "cpu": (cpu or {}).get(method, "cpu-a"),
                         "items": items_file(tmp_path / f"{dataset}-{method}-{s}.parquet", p,
                                             rng, n)})
    for method, p in (ablation or {}).items():
        for s in seeds:
            rows.append({"dataset": "d", "model": "m", "method": method, "seed": s,
                         "fraction": 0.31, "distribution": "random", "role": "ablation",
                         "items": items_file(tmp_path / f"{method}-r-{s}.parquet", p, rng)})
    return pd.DataFrame(rows)


def test_comparisons_recover_known_differences_and_pair_the_ablation(tmp_path):
    df = runs_frame(tmp_path, {"full": 0.8, "random": 0.5, "cluster": 0.5, "oracle": 0.8},
                    ablation={"cluster": 0.5})
    cmp = verdict.comparisons(df, 0.31, min_se=0.0, n_boot=500)
    got = {(r.a, r.b): r for r in cmp.itertuples()}
    assert set(got) >= {("cluster", "random"), ("oracle", "random"), ("cluster", "full"),
                        ("random", "full"), ("cluster [balanced]", "cluster [random]")}
    assert ("cluster", "oracle") not in got  # the oracle is a reference, never a contender
    assert got[("oracle", "random")].diff == pytest.approx(0.3, abs=0.05)
    assert got[("oracle", "random")].ci_low > 0.2
    assert abs(got[("cluster", "random")].diff) < 0.05
    assert got[("cluster", "random")].ci_low < 0 < got[("cluster", "random")].ci_high
    assert got[("cluster", "full")].diff == pytest.approx(-0.3, abs=0.05)
    assert got[("cluster", "random")].n_items == 600 and got[("cluster", "random")].n_seeds == 3


def test_power_line_decides_between_inconclusive_and_a_real_negative(tmp_path):
    strong = verdict.comparisons(runs_frame(tmp_path, {"random": 0.5, "cluster": 0.5,
                                                      "oracle": 0.8}), 0.31, n_boot=500)
    pw = verdict.power_lines(strong)
    assert bool(pw.iloc[0]["clears"]) and pw.iloc[0]["mde"] < 0.3
    tie = strong[(strong["a"] == "cluster") & (strong["b"] == "random")].iloc[0]
    assert verdict.verdict_better(tie, True).startswith("not reproduced (tie")
    weak = verdict.comparisons(runs_frame(tmp_path, {"random": 0.5, "cluster": 0.5,
                                                    "oracle": 0.51}), 0.31, n_boot=500)
    assert not bool(verdict.power_lines(weak).iloc[0]["clears"])
    assert verdict.verdict_better(tie, False).startswith("inconclusive")
    assert verdict.verdict_better({"ci_low": 0.01, "ci_high": 0.1}, False) == "reproduced"
    assert "other is better" in verdict.verdict_better({"ci_low": -0.1, "ci_high": -0.01}, True)


def test_near_full_is_a_non_inferiority_reading_of_the_one_sided_bounds():
    assert verdict.verdict_noninferior({"ci_low_1s": -0.01, "ci_high_1s": 0.02}, 0.02,
                                       0.01) == "reproduced"
    assert verdict.verdict_noninferior({"ci_low_1s": -0.09, "ci_high_1s": -0.03}, 0.02,
                                       0.01) == "not reproduced"
    v = verdict.verdict_noninferior({"ci_low_1s": -0.05, "ci_high_1s": 0.01}, 0.02, 0.01)
    assert v.startswith("inconclusive") and "underpowered" not in v
    v = verdict.verdict_noninferior({"ci_low_1s": -0.05, "ci_high_1s": 0.01}, 0.02, 0.05)
    assert v.startswith("inconclusive") and "underpowered: MDE 0.050 > margin 0.020" in v
    assert verdict.verdict_noninferior({"ci_low_1s": 0, "ci_high_1s": 0}, None).startswith(
        "not evaluated")
    assert "no gain to keep" in verdict.verdict_noninferior({"ci_low_1s": 0, "ci_high_1s": 0},
                                                            -0.01)


def _near_full(tmp_path, accuracy, **kw) -> pd.Series:
    cmp = verdict.comparisons(runs_frame(tmp_path, accuracy, **kw), 0.31, n_boot=500)
    claims = verdict.claims_table(cmp, pd.DataFrame(columns=TT_COLUMNS),
                                  pd.DataFrame(columns=["dataset", "model"]),
                                  pd.DataFrame(columns=["dataset", "model", "budget"]),
                                  {"claim_budget": 0.31, "near_full_margin": 0.2})
    return claims[claims["claim"] == "accuracy kept at 31% of the data"].iloc[0]


def test_near_full_non_inferiority_on_a_known_truth(tmp_path):
    """Per-item results simulated with a known gap: cluster as good as full (gap 0) ->
    reproduced; cluster far below full (gap 0.3, margin 0.2 x (0.8 - 0.3) = 0.1) -> not
    reproduced; a handful of items (huge noise) -> inconclusive and underpowered."""
    same = _near_full(tmp_path / "a", {"base": 0.3, "full": 0.8, "cluster": 0.8})
    assert same["verdict"] == "reproduced"
    assert "margin 0.1" in same["ours"] and "≤ margin: powered" in same["ours"]
    far = _near_full(tmp_path / "b", {"base": 0.3, "full": 0.8, "cluster": 0.5})
    assert far["verdict"] == "not reproduced"
    noisy = _near_full(tmp_path / "c", {"base": 0.6, "full": 0.8, "cluster": 0.75}, n=4,
                       seeds=(0, 1))
    assert noisy["verdict"].startswith("inconclusive") and "underpowered" in noisy["verdict"]
    assert "> margin: underpowered" in noisy["ours"]
    no_base = _near_full(tmp_path / "d", {"full": 0.8, "cluster": 0.8})
    assert no_base["verdict"].startswith("not evaluated")


def test_min_se_floors_only_comparisons_across_machines(tmp_path):
    """Paired runs of one machine keep their bootstrap se (below the floor given here); the
    same runs with random trained on another CPU kind get the floor, and its MDE."""
    acc = {"random": 0.5, "cluster": 0.55}
    one = verdict.comparisons(runs_frame(tmp_path / "one", acc), 0.31, min_se=0.1, n_boot=300)
    r = one[(one["a"] == "cluster") & (one["b"] == "random")].iloc[0]
    assert not r["cross_machine"] and r["se"] < 0.1
    assert r["mde"] == pytest.approx(minimum_detectable_difference(r["se"]))
    two = verdict.comparisons(runs_frame(tmp_path / "two", acc, cpu={"random": "cpu-b"}),
                              0.31, min_se=0.1, n_boot=300)
    r2 = two[(two["a"] == "cluster") & (two["b"] == "random")].iloc[0]
    assert r2["cross_machine"] and r2["se"] == 0.1
    assert r2["mde"] == pytest.approx(minimum_detectable_difference(0.1))


TT_COLUMNS = ["dataset", "model", "method", "fraction", "gpus", "distribution", "epochs",
              "precision", "n_seeds", "wall_time_s_mean", "ratio_to_full", "imbalance_mean"]


def test_claims_table_has_a_row_per_claim_and_the_diagnosis(tmp_path):
    df = runs_frame(tmp_path, {"base": 0.3, "full": 0.8, "random": 0.5, "cluster": 0.5,
                               "oracle": 0.8}, ablation={"cluster": 0.5})
    cmp = verdict.comparisons(df, 0.31, n_boot=300)
    tt = pd.DataFrame([
        {"dataset": "d", "model": "m", "method": "cluster", "fraction": 0.31, "gpus": g,
         "distribution": dist, "epochs": "1", "precision": "fp32", "n_seeds": 1,
         "wall_time_s_mean": w, "ratio_to_full": r, "imbalance_mean": 1.0}
        for g, dist, w, r in ((4, "balanced", 9.0, 0.3), (4, "random", 10.0, 0.55))])
    claims = verdict.claims_table(cmp, tt, pd.DataFrame(columns=["dataset", "model"]),
                                  pd.DataFrame(columns=["dataset", "model", "budget"]),
                                  {"claim_budget": 0.31, "near_full_margin": 0.2})
    by = claims.groupby("claim")["verdict"].apply(list).to_dict()
    assert by["accuracy kept at 31% of the data"] == ["not reproduced"]
    assert by["better than usual selection"] == [
        "not reproduced (tie; the benchmark can tell selections apart)"]
    assert by["faster than the usual distribution at 4 GPUs"] == ["reproduced"]
    assert by[CONTROL] == ["positive control passed"]
    # one figure, 0.304 of full ("10 h → about 3 h" = "reduced by 69.6%"): 0.3 meets it,
    # 0.55 does not; the literal other reading (0.696) is a note, never a verdict
    time_rows = claims[claims["claim"] == "training time cut"]
    assert time_rows["verdict"].tolist() == ["reproduced", "not reproduced"]
    assert "0.696" not in " ".join(time_rows["verdict"])
    assert any("0.696" in n and "no verdict" in n for n in verdict.NOTES)


def test_skill_recovery_and_label_counts_from_files(tmp_path):
    ids = [f"x{i}" for i in range(12)]
    truth = ["a"] * 6 + ["b"] * 4 + ["c"] * 2
    clusters = [0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2]
    write_parquet(tmp_path / "labels.parquet", pd.DataFrame({"id": ids, "label": truth}))
    write_parquet(tmp_path / "c.parquet", pd.DataFrame({"id": ids[::-1],
                                                        "cluster": clusters[::-1]}))
    sr = verdict.skill_recovery([{"dataset": "d", "model": "m", "seed": 0, "features": "tfidf",
                                  "clusters": str(tmp_path / "c.parquet"),
                                  "labels": str(tmp_path / "labels.parquet")}])
    want = cluster_agreement(np.array(clusters), np.array(truth))
    assert sr.iloc[0]["ari"] == pytest.approx(want["ari"])
    assert sr.iloc[0]["label_coverage"] == pytest.approx(want["label_coverage"])
    write_parquet(tmp_path / "sel.parquet", pd.DataFrame({"id": ["x0", "x1", "x6"],
                                                          "cluster": 0, "score": 0.0}))
    lc = verdict.label_counts([{"dataset": "d", "model": "m", "method": "random",
                                "budget": 0.25, "seed": 0,
                                "selection": str(tmp_path / "sel.parquet")}],
                              {"d": str(tmp_path / "labels.parquet")})
    assert dict(zip(lc["label"], lc["n_selected"])) == {"a": 2, "b": 1, "c": 0}
    ls = verdict.label_summary(lc).iloc[0]
    assert ls["labels_missing"] == 1 and ls["n_labels"] == 3
    # the rarer half (pool count below the median 4): label c, none selected; pool share 2/12
    assert ls["rare_share"] == 0 and ls["rare_share_pool"] == pytest.approx(2 / 12)


def test_speed_claim_is_read_against_the_cost_model_noise(tmp_path):
    """With a balance_cost row, a balanced/random ratio within 2 noise is inconclusive and
    the row names the cost model's predictions; outside it, the ratio decides."""
    assert verdict.speed_verdict(0.9, 0.1).startswith("inconclusive")
    assert verdict.speed_verdict(0.9, 0.01) == "reproduced"
    assert verdict.speed_verdict(1.1, 0.01) == "not reproduced"
    assert verdict.speed_verdict(0.99, None) == "reproduced"
    df = runs_frame(tmp_path, {"full": 0.8, "random": 0.5, "cluster": 0.5, "oracle": 0.8})
    cmp = verdict.comparisons(df, 0.31, n_boot=100)
    tt = pd.DataFrame([
        {"dataset": "d", "model": "m", "method": "cluster", "fraction": 0.31, "gpus": 4,
         "distribution": dist, "epochs": "1", "precision": "fp32", "n_seeds": 1,
         "wall_time_s_mean": w, "ratio_to_full": 0.5, "imbalance_mean": 1.0}
        for dist, w in (("balanced", 9.0), ("random", 10.0))])
    bt = pd.DataFrame([{"dataset": "d", "model": "m", "gpus": 4, "method": "cluster",
                        "budget": 0.31, "ratio_noise": 0.12, "predicted_ratio": 0.98,
                        "gpu_predicted_ratio": 0.97}])
    empty = (pd.DataFrame(columns=["dataset", "model"]),
             pd.DataFrame(columns=["dataset", "model", "budget"]))
    claims = verdict.claims_table(cmp, tt, *empty, {"claim_budget": 0.31,
                                                    "near_full_margin": 0.2}, bt)
    row = claims[claims["claim"] == "faster than the usual distribution at 4 GPUs"].iloc[0]
    assert row["verdict"] == "inconclusive (within the CPU-rank noise ±0.240)"
    assert "cost model predicts 0.980" in row["ours"] and "GPU default 0.970" in row["ours"]


def test_skill_recovery_of_an_unlabelled_pool_is_not_applicable(tmp_path):
    """A hub pool without a label column (every example 'unlabelled': ARI 0 for every
    feature kind) gets no 'best' feature: the diagnosis row says it does not apply (the
    rehearsal's report called 'loss' best on an unlabelled pool before). A labelled pool
    whose kinds cluster alike (one seed: no interval) is a tie, never a 'best'."""
    df = runs_frame(tmp_path, {"full": 0.8, "random": 0.5, "cluster": 0.5})
    cmp = verdict.comparisons(df, 0.31, n_boot=100)
    tt = pd.DataFrame([
        {"dataset": "d", "model": "m", "method": "cluster", "fraction": 0.31, "gpus": 4,
         "distribution": dist, "epochs": "1", "precision": "fp32", "n_seeds": 1,
         "wall_time_s_mean": 10.0, "ratio_to_full": 0.5, "imbalance_mean": 1.0}
        for dist in ("balanced", "random")])
    ids = [f"x{i}" for i in range(6)]
    write_parquet(tmp_path / "c.parquet", pd.DataFrame({"id": ids, "cluster": [0, 0, 1, 1, 2, 2]}))
    ls = pd.DataFrame(columns=["dataset", "model", "budget"])
    cfg = {"claim_budget": 0.31, "near_full_margin": 0.2}
    got = {}
    for name, truth in (("none", ["unlabelled"] * 6), ("some", ["a", "a", "b", "b", "c", "c"])):
        write_parquet(tmp_path / f"{name}.parquet", pd.DataFrame({"id": ids, "label": truth}))
        sr = verdict.skill_recovery([{"dataset": "d", "model": "m", "seed": 0, "features": f,
                                      "clusters": str(tmp_path / "c.parquet"),
                                      "labels": str(tmp_path / f"{name}.parquet")}
                                     for f in ("gradient", "loss")])
        claims = verdict.claims_table(cmp, tt, verdict.skill_recovery_summary(sr), ls, cfg)
        got[name] = claims[claims["claim"] == "skill recovery (diagnosis)"]["verdict"].tolist()
    assert got["none"] == ["not applicable: the pool carries no skill labels (map a `label` "
                           "column to measure it)"]
    assert got["some"] == ["tie: gradient, loss"]


def test_testbed_rows_positive_control_share_scope_and_why(tmp_path):
    """Every dataset x model gets its scope note (by source), the positive control, the
    method's share of the oracle's gain and a 'why' row; a testbed whose oracle does not beat
    random says the control FAILED, and leaves the share undefined."""
    empty_tt = pd.DataFrame(columns=TT_COLUMNS)
    strong = runs_frame(tmp_path / "a", {"base": 0.3, "full": 0.8, "random": 0.6, "cluster": 0.7,
                                         "oracle": 0.8}, dataset="cip")
    weak = runs_frame(tmp_path / "b", {"base": 0.3, "full": 0.8, "random": 0.6, "cluster": 0.6,
                                       "oracle": 0.6}, dataset="py")
    cmp = verdict.comparisons(pd.concat([strong, weak]), 0.31, n_boot=500)
    sr = pd.DataFrame([{"dataset": "cip", "model": "m", "features": "gradient", "n_labels": 8,
                        "ari": 0.4, "ari_ci": 0.05}])
    ls = pd.DataFrame([{"dataset": "cip", "model": "m", "method": "cluster", "budget": 0.31,
                        "n_labels": 8, "labels_missing": 1.0, "rare_share": 0.3,
                        "rare_share_pool": 0.3, "n_seeds": 3}])
    claims = verdict.claims_table(cmp, empty_tt, sr, ls, {"claim_budget": 0.31,
                                                          "near_full_margin": 0.2},
                                  sources={"cip": "cipher", "py": "pycode"})
    got = {(r.dataset, r.claim): r for r in claims.itertuples()}
    assert got[("cip", "what this dataset can decide (diagnosis)")].ours == verdict.SKILL_LABELS
    assert got[("py", "what this dataset can decide (diagnosis)")].ours.startswith(
        "labels are stdlib modules")
    assert got[("cip", CONTROL)].verdict == "positive control passed"
    assert got[("py", CONTROL)].verdict == \
        "positive control FAILED: the testbed cannot tell selections apart"
    share = cmp[(cmp["dataset"] == "cip") & (cmp["a"] == "cluster") & (cmp["b"] == "random")]
    assert share["share_of_oracle"].iloc[0] == pytest.approx(0.5, abs=0.15)
    assert share["share_low"].iloc[0] < share["share_of_oracle"].iloc[0] < share[
        "share_high"].iloc[0]
    assert "(cluster − random) / (oracle − random) = " in got[
        ("cip", "share of the oracle's gain recovered (diagnosis)")].ours
    why = got[("cip", "why (diagnosis)")].ours
    assert why.startswith("gradient clusters recover skills with ARI 0.40; the method's "
                          "selection covers 7.0 of 8 skills; so it recovers ")
    assert "not detectable" in got[("py", "why (diagnosis)")].ours
    # no source given: the dataset's name is taken as its source
    alone = verdict.claims_table(cmp, empty_tt, sr, ls, {"claim_budget": 0.31,
                                                         "near_full_margin": 0.2})
    note = alone[alone["claim"] == "what this dataset can decide (diagnosis)"]
    assert note["test"].tolist() == ["source: cip", "source: py"]


def test_best_feature_kind_only_when_its_interval_clears_the_runner_up():
    def sr(*kinds):
        return pd.DataFrame([{"features": f, "ari": a, "ari_ci": c} for f, a, c in kinds])

    assert verdict.verdict_best_features(sr(("gradient", 0.5, 0.05),
                                            ("embedding", 0.2, 0.05))) == "gradient best"
    # the rehearsal: gradient and embedding both ARI 0.06 -> a tie, not 'gradient best'
    assert verdict.verdict_best_features(sr(("gradient", 0.061, 0.02), ("embedding", 0.060, 0.02),
                                            ("tfidf", 0.0, 0.01))) == "tie: gradient, embedding"
    assert verdict.verdict_best_features(sr(("loss", 0.3, float("nan")),
                                            ("gradient", 0.1, 0.01))) == "tie: loss, gradient"
