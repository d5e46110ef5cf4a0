"""Target-aware selection (clusterft.tasks.targets): validation records render to the evaluated
prompt, LESS / RDS+ rules on hand-computed cases, and target features from score and
features (same warm-up / projection / model; the pool's rows unchanged)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from clusterft.pipeline import provenance
from clusterft.stages.data.prepare import run_prepare_data
from clusterft.pipeline.errors import InputError
from clusterft.pipeline.io import read_jsonl
from clusterft.pools.poolfile import load_pool
from clusterft.modeling.prompt import render_example, render_prompt
from clusterft.tasks.targets import (item_record, less_scores, rds_round_robin, resolve_targets,
                               top_k, val_records)
from clusterft.tasks.registry import TASKS, tasks_for_dataset, val_file

FAST = {"dim": 32, "batch_size": 8, "max_length": 64, "warmup_steps": 4, "warmup_lr": 5e-3,
        "warmup_fraction": 0.25, "lora": {"r": 4, "alpha": 8}, "loss_points": 2,
        "checkpoint_every": 0}
EMB = {"batch_size": 8, "max_length": 64, "device": "cpu"}


# The tiny models run several times faster on 1 thread than on 2 shared cores.
pytestmark = pytest.mark.usefixtures("one_thread")


def unit(*rows) -> np.ndarray:
    a = np.asarray(rows, dtype=np.float64)
    return a / np.linalg.norm(a, axis=1, keepdims=True)


# ------------------------------------------------------------------ validation records

def test_val_records_render_to_the_evaluated_prompt(prepared_root):
    root, summaries = prepared_root
    bench = root / "bench"
    for task, spec in TASKS.items():
        items = read_jsonl(val_file(bench, task))
        assert items, task
        recs, task_of = val_records(bench, [task])
        assert task_of == [task] * len(items) and len(recs) == len(items)
        for it, rec in zip(items, recs):
            assert rec["id"] == it["id"] and rec["source"] == f"val/{task}"
            assert [m["role"] for m in rec["messages"]] == ["user", "assistant"]
            prompt, response = render_example(rec["messages"])
            assert prompt == it["prompt"] and render_prompt(rec["messages"]) == it["prompt"]
            if spec.output_type == "multiple_choice":
                assert response == it["choices"][it["label"]]
            else:  # a pool example's response: skills and cipher ones start with a space
                prefix = " " if spec.dataset in ("skills", "cipher") else ""
                assert response == prefix + it["answer"]
    # the skills generation records look like the skills pool's responses
    pool = load_pool(root / "skills" / "pool.jsonl")
    recs, _ = val_records(bench, ["skills_numbers"])
    assert all(r["messages"][-1]["content"].startswith(" ") for r in recs)
    assert all(r["messages"][-1]["content"].startswith(" ") for r in pool)
    # several tasks: in the given order, ids unique
    recs, task_of = val_records([bench], ["icd10_code_chapter", "skills_mc"])
    assert task_of == sorted(task_of) and len({r["id"] for r in recs}) == len(recs)


def test_val_records_errors(tmp_path):
    with pytest.raises(InputError, match="val_per_task") as ei:
        val_records(tmp_path, ["skills_mc"])
    assert str(val_file(tmp_path, "skills_mc")) in str(ei.value)
    val_file(tmp_path, "skills_mc").write_text(
        json.dumps({"id": "a", "prompt": "### Instruction:\nx\n\n### Response:\n",
                    "choices": [" a", " b"]}) + "\n")
    with pytest.raises(InputError) as ei:
        val_records(tmp_path, ["skills_mc"])
    assert ei.value.line == 1
    val_file(tmp_path, "skills_mc").write_text("")
    with pytest.raises(InputError, match="no validation items"):
        val_records(tmp_path, ["skills_mc"])
    # an unwrapped prompt is kept whole as the user message
    rec = item_record({"id": "u", "prompt": "2+2=", "answer": "4"}, "mine")
    assert rec["messages"][0]["content"] == "2+2=" and rec["messages"][1]["content"] == "4"


def test_resolve_targets_forms(prepared_root):
    root, _ = prepared_root
    bench = root / "bench"
    recs, tasks = val_records(bench, ["skills_mc", "icd10_block_mc"])
    for form in ((bench, ["skills_mc", "icd10_block_mc"]),
                 {"items_dir": str(bench), "tasks": ["skills_mc", "icd10_block_mc"]}):
        r, t, dirs = resolve_targets(form)
        assert r == recs and t == tasks and dirs == [bench]
    r, t, dirs = resolve_targets((recs, tasks))
    assert r == recs and t == tasks and dirs == []
    with pytest.raises(InputError):
        resolve_targets((recs, tasks[:-1]))
    with pytest.raises(InputError):
        resolve_targets("nope")


# ------------------------------------------------------------------ selection rules

def test_less_scores_hand_computed():
    pool = unit([1, 0, 0], [0, 1, 0], [0, 0, 1], [1, 1, 0])
    target = unit([1, 0, 0], [0, 1, 0], [0, 0, 1])
    task = ["a", "a", "b"]
    # task a: mean of the cosines with (1,0,0) and (0,1,0); task b: cosine with (0,0,1)
    s2 = 1 / np.sqrt(2)
    a = np.array([0.5, 0.5, 0.0, s2])
    b = np.array([0.0, 0.0, 1.0, 0.0])
    np.testing.assert_allclose(less_scores(pool, target, task), np.maximum(a, b))
    np.testing.assert_allclose(less_scores(pool, target, task, agg="max"), [0.5, 0.5, 1, s2])
    np.testing.assert_allclose(less_scores(pool, target, task, agg="mean"), (a + b) / 2)
    np.testing.assert_allclose(less_scores(pool, target, task, agg="mean"),
                               [0.25, 0.25, 0.5, s2 / 2])
    # max and mean rank differently: max favours the example that fits one task well
    assert np.argmax(less_scores(pool, target, task, "max")) == 2
    assert np.argmax(less_scores(pool, target, task, "mean")) == 2
    pool2 = unit([1, 0, 0], [0.6, 0, 0.8])
    mx, mn = less_scores(pool2, target, task, "max"), less_scores(pool2, target, task, "mean")
    np.testing.assert_allclose(mx, [0.5, 0.8])
    np.testing.assert_allclose(mn, [0.25, 0.55])
    # a task with many validation examples does not outweigh one with few (per-task means)
    many = unit(*([[1, 0, 0]] * 9 + [[0, 1, 0]]))
    np.testing.assert_allclose(less_scores(unit([0, 1, 0]), many, ["a"] * 9 + ["b"]), [1.0])
    with pytest.raises(ValueError, match="agg"):
        less_scores(pool, target, task, agg="sum")
    with pytest.raises(ValueError, match="unit-norm"):
        less_scores(pool * 2, target, task)
    with pytest.raises(ValueError, match="columns"):
        less_scores(unit([1, 0]), target, task)
    with pytest.raises(ValueError, match="target tasks"):
        less_scores(pool, target, task[:2])


def test_top_k_ties_by_lower_index():
    s = np.array([0.1, 0.5, 0.5, 0.9, 0.5, -1.0])
    assert top_k(s, 0).tolist() == []
    assert top_k(s, 1).tolist() == [3]
    assert top_k(s, 2).tolist() == [1, 3]
    assert top_k(s, 3).tolist() == [1, 2, 3]
    assert top_k(s, 4).tolist() == [1, 2, 3, 4]
    assert top_k(s, 6).tolist() == list(range(6))
    for bad in (7, -1, 1.5):
        with pytest.raises(ValueError):
            top_k(s, bad)
    with pytest.raises(ValueError):
        top_k([0.1, np.nan], 1)


def test_rds_round_robin_matches_a_plain_reference():
    """Random rows, 3 tasks of unequal size: the tasks (sorted) take turns, each its best
    (by mean cosine to its validation rows; ties by lower index) not taken yet."""
    rng = np.random.default_rng(0)
    pool = unit(*rng.standard_normal((40, 5)))
    target = unit(*rng.standard_normal((7, 5)))
    task = ["c", "a", "b", "a", "c", "c", "a"]
    order = {}
    for name in sorted(set(task)):
        sim = [float(np.mean([pool[i] @ target[j] for j in range(7) if task[j] == name]))
               for i in range(40)]
        order[name] = sorted(range(40), key=lambda i: (-sim[i], i))
    taken: list[int] = []
    while len(taken) < 40:
        for name in sorted(order):
            if len(taken) < 40:
                taken.append(next(i for i in order[name] if i not in taken))
    for n in (0, 1, 2, 3, 4, 10, 39, 40):
        assert rds_round_robin(pool, target, task, n).tolist() == sorted(taken[:n])


def test_rds_round_robin_constructed_case():
    # pool examples 0-2 close to task "x" = (1, 0), 3-5 to task "y" = (0, 1):
    # x ranks 0, 1, 2, 3, 4, 5 and y ranks 5, 4, 3, 2, 1, 0
    pool = unit([1, 0], [0.9, 0.1], [0.5, 0.5], [0.45, 0.55], [0.1, 0.9], [0, 1])
    target = unit([1, 0], [0, 1])
    # turns x, y, x, y, ...: 0, 5, 1, 4, 2, 3
    assert rds_round_robin(pool, target, ["x", "y"], 1).tolist() == [0]
    assert rds_round_robin(pool, target, ["x", "y"], 2).tolist() == [0, 5]
    assert rds_round_robin(pool, target, ["x", "y"], 3).tolist() == [0, 1, 5]
    assert rds_round_robin(pool, target, ["x", "y"], 4).tolist() == [0, 1, 4, 5]
    assert rds_round_robin(pool, target, ["x", "y"], 5).tolist() == [0, 1, 2, 4, 5]
    assert rds_round_robin(pool, target, ["x", "y"], 6).tolist() == list(range(6))
    # the tasks take turns in sorted order, whatever the order of the target rows
    assert rds_round_robin(pool, target[::-1], ["y", "x"], 1).tolist() == [0]
    # a taken example is skipped: both tasks' best is example 0, so y takes its second
    both = unit([1, 1], [0.6, -0.8], [-0.8, 0.6])
    assert rds_round_robin(both, target, ["x", "y"], 2).tolist() == [0, 2]
    # the top 2 of LESS's max over tasks take both from task x; the round robin one each
    skew = unit([1, 0], [0.99, 0.14], [0.6, 0.8])
    assert top_k(less_scores(skew, target, ["x", "y"]), 2).tolist() == [0, 1]
    assert rds_round_robin(skew, target, ["x", "y"], 2).tolist() == [0, 2]
    # several validation rows per task: ranked by the mean cosine
    t2 = unit([1, 0], [0.8, 0.6], [0, 1])
    sim_x = skew @ t2[:2].mean(0)
    assert rds_round_robin(skew, t2, ["x", "x", "y"], 1).tolist() == [int(np.argmax(sim_x))]
    with pytest.raises(ValueError):
        rds_round_robin(pool, target, ["x", "y"], 7)


# ------------------------------------------------------------------ target features

@pytest.fixture(scope="module")
def prepared_skills(tmp_path_factory):
    """A small skills run (its own items folder, with provenance) and a second run of
    another seed, for the lineage check."""
    root = tmp_path_factory.mktemp("targets")
    out = {}
    for name, seed in (("a", 0), ("b", 1)):
        d = root / name
        run_prepare_data("skills", {"n": 96, "items_per_task": 20, "val_per_task": 4},
                         d / "pool.jsonl", d / "labels.parquet", d / "items", seed=seed)
        out[name] = d
    return out


def test_run_score_with_targets(prepared_skills, tiny_model_dir, tmp_path):
    from clusterft.stages.score import run_score

    d = prepared_skills["a"]
    tasks = tasks_for_dataset("skills")
    recs, task_of = val_records(d / "items", tasks)
    assert len(recs) == 12
    runs = {}
    for name, gtype, targets in (("plain", "sgd", None), ("sgd", "sgd", (d / "items", tasks)),
                                 ("adam_plain", "adam", None),
                                 ("adam", "adam", (recs, task_of))):
        o = tmp_path / name
        kw = ({} if targets is None else
              {"targets": targets, "out_targets": o / "targets.npy",
               "out_target_ids": o / "target_ids.parquet"})
        info = run_score(tiny_model_dir, d / "pool.jsonl", {**FAST, "gradient_type": gtype},
                         o / "features.npy", o / "scores.parquet", seed=0, **kw)
        runs[name] = o
        if targets is not None:
            assert info["n_targets"] == 12
    for with_t, without in (("sgd", "plain"), ("adam", "adam_plain")):
        a, b = runs[with_t], runs[without]
        # the pool's outputs are the same bytes with or without targets
        assert (a / "features.npy").read_bytes() == (b / "features.npy").read_bytes()
        assert (a / "scores.parquet").read_bytes() == (b / "scores.parquet").read_bytes()
        t = np.load(a / "targets.npy")
        assert t.shape == (12, FAST["dim"]) and t.dtype == np.float32
        np.testing.assert_allclose(np.linalg.norm(t, axis=1), 1.0, rtol=1e-5)
        ids = pd.read_parquet(a / "target_ids.parquet")
        assert list(ids.columns) == ["id", "task"]
        assert ids["id"].tolist() == [r["id"] for r in recs] and ids["task"].tolist() == task_of
        prov = provenance.read(a / "targets.npy")
        assert prov["output"] == "targets" and "data[skills]" in prov["lineage"]
        assert provenance.read(a / "features.npy")["lineage"]["score_run"] == \
            prov["lineage"]["score_run"]
    # the items folder is an input when the targets come from it
    assert "items" in provenance.read(runs["sgd"] / "targets.npy")["inputs"]
    # gradient_type adam: the pool rows are Adam directions, the targets keep plain (SGD)
    # gradients, as in LESS: the same warm-up, so the same target rows as under sgd
    assert not np.allclose(np.load(runs["sgd"] / "features.npy"),
                           np.load(runs["adam"] / "features.npy"))
    np.testing.assert_allclose(np.load(runs["sgd"] / "targets.npy"),
                               np.load(runs["adam"] / "targets.npy"), atol=1e-6)


def test_score_target_row_of_a_pool_example_is_its_pool_row(tiny_model_dir, tiny_pool_path,
                                                            tiny_pool, tmp_path):
    from clusterft.stages.score import run_score

    picks = [3, 17, 40]
    recs = [dict(tiny_pool[i], id=f"copy-{i}") for i in picks]
    run_score(tiny_model_dir, tiny_pool_path, {**FAST, "warmup_checkpoints": 2}, tmp_path / "f.npy",
              tmp_path / "s.parquet", seed=0, targets=(recs, ["t"] * 3),
              out_targets=tmp_path / "t.npy", out_target_ids=tmp_path / "t.parquet")
    f, t = np.load(tmp_path / "f.npy"), np.load(tmp_path / "t.npy")
    assert t.shape == (3, 2 * FAST["dim"])
    np.testing.assert_allclose(t, f[picks], atol=2e-5)
    assert provenance.read(tmp_path / "t.npy")["output"] == "targets"


def test_targets_of_another_prepare_run_are_refused(prepared_skills, tiny_model_dir, tmp_path):
    from clusterft.stages.features.representations import run_features
    from clusterft.stages.score import run_score

    a, b = prepared_skills["a"], prepared_skills["b"]
    tasks = tasks_for_dataset("skills")
    kw = {"targets": (b / "items", tasks), "out_targets": tmp_path / "t.npy",
          "out_target_ids": tmp_path / "t.parquet"}
    with pytest.raises(InputError, match="do not belong together") as ei:
        run_score(tiny_model_dir, a / "pool.jsonl", FAST, tmp_path / "f.npy",
                  tmp_path / "s.parquet", **kw)
    assert "data[skills]" in str(ei.value)
    with pytest.raises(InputError, match="do not belong together"):
        run_features("embedding", a / "pool.jsonl", tmp_path / "f.npy", tmp_path / "s.parquet",
                     EMB, model_dir=tiny_model_dir, **kw)
    assert not (tmp_path / "f.npy").exists()
    with pytest.raises(InputError, match="targets needs out_targets"):
        run_score(tiny_model_dir, a / "pool.jsonl", FAST, tmp_path / "f.npy",
                  tmp_path / "s.parquet", targets=(a / "items", tasks))
    with pytest.raises(InputError, match="embedding"):
        run_features("tfidf", a / "pool.jsonl", tmp_path / "f.npy", tmp_path / "s.parquet",
                     **{**kw, "targets": (a / "items", tasks)})


def test_run_features_embedding_targets(prepared_skills, tiny_model_dir, tmp_path):
    from clusterft.stages.features.representations import run_features

    d = prepared_skills["a"]
    tasks = tasks_for_dataset("skills")
    pool = load_pool(d / "pool.jsonl")
    run_features("embedding", d / "pool.jsonl", tmp_path / "p" / "f.npy",
                 tmp_path / "p" / "s.parquet", EMB, model_dir=tiny_model_dir)
    info = run_features("embedding", d / "pool.jsonl", tmp_path / "t" / "f.npy",
                        tmp_path / "t" / "s.parquet", EMB, model_dir=tiny_model_dir,
                        targets={"items_dir": d / "items", "tasks": tasks},
                        out_targets=tmp_path / "t" / "targets.npy",
                        out_target_ids=tmp_path / "t" / "target_ids.parquet")
    assert info["n_targets"] == 12
    for name in ("f.npy", "s.parquet"):
        assert (tmp_path / "p" / name).read_bytes() == (tmp_path / "t" / name).read_bytes()
    f, t = np.load(tmp_path / "t" / "f.npy"), np.load(tmp_path / "t" / "targets.npy")
    assert t.shape == (12, f.shape[1]) and t.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(t, axis=1), 1.0, rtol=1e-5)
    ids = pd.read_parquet(tmp_path / "t" / "target_ids.parquet")
    assert ids["task"].tolist() == val_records(d / "items", tasks)[1]
    prov = provenance.read(tmp_path / "t" / "targets.npy")
    assert prov["stage"] == "features-embedding" and "items" in prov["inputs"]
    # a target that is a pool example gets that example's row
    recs = [dict(pool[i], id=f"copy-{i}") for i in (0, 5)]
    run_features("embedding", d / "pool.jsonl", tmp_path / "c" / "f.npy",
                 tmp_path / "c" / "s.parquet", EMB, model_dir=tiny_model_dir,
                 targets=(recs, ["x", "y"]), out_targets=tmp_path / "c" / "t.npy",
                 out_target_ids=tmp_path / "c" / "t.parquet")
    np.testing.assert_allclose(np.load(tmp_path / "c" / "t.npy"), f[[0, 5]], atol=1e-5)
    # and the rule runs on them: RDS+ takes a pool example per task in turn
    sel = rds_round_robin(f, t, ids["task"].tolist(), 6)
    assert len(sel) == 6 and len(set(sel.tolist())) == 6


def test_no_validation_examples_write_empty_target_files(tmp_path):
    from clusterft.tasks.targets import check_outputs, write_outputs

    check_outputs(None, tmp_path / "t.npy", tmp_path / "t.parquet")  # empty files: allowed
    with pytest.raises(InputError, match="targets needs out_targets"):
        check_outputs(("items", ["t"]), None, None)
    with pytest.raises(InputError, match="targets needs out_targets"):
        check_outputs(None, tmp_path / "t.npy", None)
    out = write_outputs(tmp_path / "t.npy", tmp_path / "t.parquet", None, None, [], 12)
    assert out == {"targets": tmp_path / "t.npy", "target_ids": tmp_path / "t.parquet"}
    assert np.load(tmp_path / "t.npy").shape == (0, 12)
    assert pd.read_parquet(tmp_path / "t.parquet").empty
