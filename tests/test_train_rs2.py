"""RS2 selections (a fresh subset per epoch, an ``epoch`` column): the epoch column's checks,
training epoch e on subset e mod E with a real tiny model (1 and 2 ranks), the step count of
one subset, distinct examples, and resume from a checkpoint inside a later epoch."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest
import torch

from clusterft.pipeline.errors import InputError
from clusterft.pipeline.io import write_parquet
from clusterft.pools.poolfile import epoch_subsets, read_selection, select_records
from clusterft.stages.train import ids_sha1, load_selection, run_train
from test_train import BASE_CFG, make_selection, torchrun, weights


def rs2_selection(path: Path, pool: list[dict], subsets: list[list[int]], k: int = 4) -> Path:
    """Rows (id, cluster, score, epoch) for each epoch's pool indices; cluster = index mod k."""
    rows = [{"id": pool[i]["id"], "cluster": i % k, "score": float(i), "epoch": e}
            for e, sub in enumerate(subsets) for i in sub]
    write_parquet(path, pd.DataFrame(rows))
    return path


def sha(pool: list[dict], sub: list[int]) -> str:
    return ids_sha1(pool[i]["id"] for i in sub)


def train(tmp_path: Path, name: str, model, pool_path, sel: Path, cfg: dict, seed: int = 0,
          distribution: str = "random") -> tuple[dict, Path]:
    out, met = tmp_path / name, tmp_path / f"{name}.json"
    m = run_train(model, pool_path, sel, out, met, distribution, seed, cfg, job_threads=1)
    assert json.loads(met.read_text())["steps"] == m["steps"]
    return m, out


@pytest.fixture(autouse=True)
def _keep_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


# --------------------------------------------------------------------------- the epoch column

def test_epoch_subsets_of_a_selection(tmp_path, tiny_pool):
    subs = [[5, 1, 9, 3], [3, 7, 2, 11]]
    sel = read_selection(rs2_selection(tmp_path / "s.parquet", tiny_pool, subs))
    records, clusters, lines = select_records(tiny_pool, sel)
    assert [r["id"] for r in records] == [tiny_pool[i]["id"] for i in (1, 2, 3, 5, 7, 9, 11)]
    assert lines == [2, 3, 4, 6, 8, 10, 12] and clusters.tolist() == [1, 2, 3, 1, 3, 1, 3]
    got = epoch_subsets(sel, records)
    assert [[records[i]["id"] for i in s] for s in got] == \
        [[tiny_pool[i]["id"] for i in sorted(s)] for s in subs]  # pool order within an epoch
    fixed = read_selection(make_selection(tmp_path / "f.parquet", tiny_pool, 4))
    assert epoch_subsets(fixed, select_records(tiny_pool, fixed)[0]) is None


BAD_EPOCHS = {
    "missing epoch 0": ([1, 1, 2, 2], "no rows for epoch 0"),
    "gap": ([0, 0, 2, 2], "no rows for epoch 1"),
    "unequal sizes": ([0, 0, 0, 1], "same size"),
    "negative": ([0, -1, 0, -1], ">= 0"),
    "not integers": ([0.0, 0.5, 1.0, 1.0], "integers"),
}


@pytest.mark.parametrize("case", sorted(BAD_EPOCHS))
def test_malformed_epoch_column(tmp_path, tiny_pool, case):
    epochs, what = BAD_EPOCHS[case]
    p = tmp_path / "bad.parquet"
    write_parquet(p, pd.DataFrame({"id": [r["id"] for r in tiny_pool[:4]], "cluster": [0] * 4,
                                   "score": [0.0] * 4, "epoch": epochs}))
    with pytest.raises(InputError, match=what) as e:
        read_selection(p)
    assert e.value.field == "epoch" and e.value.path == str(p) and "field 'epoch'" in str(e.value)


def test_duplicate_id_within_an_epoch(tmp_path, tiny_pool, tiny_model_dir, tiny_pool_path):
    ids = [r["id"] for r in tiny_pool[:3]]
    p = tmp_path / "dup.parquet"  # ids[0] twice in epoch 1 (recurring across epochs is fine)
    write_parquet(p, pd.DataFrame({"id": ids + [ids[0], ids[0], ids[1]], "cluster": [0] * 6,
                                   "score": [0.0] * 6, "epoch": [0, 0, 0, 1, 1, 1]}))
    with pytest.raises(InputError, match=f"'{ids[0]}' appears twice in epoch 1") as e:
        read_selection(p)
    assert e.value.field == "epoch" and e.value.path == str(p)
    with pytest.raises(InputError, match="field 'epoch'"):  # train stops before any work
        run_train(tiny_model_dir, tiny_pool_path, p, tmp_path / "o", tmp_path / "m.json",
                  "random", 0, BASE_CFG)
    q = tmp_path / "clusters.parquet"  # an id changing cluster between epochs
    write_parquet(q, pd.DataFrame({"id": ids[:2] * 2, "cluster": [0, 1, 0, 2],
                                   "score": [0.0] * 4, "epoch": [0, 0, 1, 1]}))
    with pytest.raises(InputError, match="different clusters") as e:
        read_selection(q)
    assert e.value.field == "cluster"
    r = tmp_path / "unknown.parquet"  # every id must be in the pool, as without epochs
    write_parquet(r, pd.DataFrame({"id": ids[:1] + ["nope"], "cluster": [0, 0],
                                   "score": [0.0, 0.0], "epoch": [0, 1]}))
    with pytest.raises(InputError, match="'nope'.*not in the pool") as e:
        select_records(tiny_pool, read_selection(r), "pool", str(r))
    assert e.value.field == "id"


def test_each_distinct_record_tokenised_once(tmp_path, tiny_pool, tiny_model_dir, tiny_pool_path):
    """The examples are the union of the subsets, once each; with truncation: reject, the
    subsets lose exactly their rejected records."""
    from clusterft.modeling.hf import load_tokenizer
    from clusterft.modeling.tokenize import encode_records

    subs = [list(range(0, 12)), list(range(6, 18)), list(range(12, 24))]
    sel = rs2_selection(tmp_path / "s.parquet", tiny_pool, subs)
    tok = load_tokenizer(tiny_model_dir)
    lens = [e["length"] for e in encode_records(tok, tiny_pool[:24], 256)[0]]
    cut = sorted(lens)[len(lens) // 2]  # about half the records are longer
    cfg = {"max_length": cut, "truncation": "reject"}
    examples, clusters, rejected, got = load_selection(tok, tiny_pool_path, sel, cfg)
    long = {tiny_pool[i]["id"] for i in range(24) if lens[i] > cut}
    assert 0 < rejected == len(long) < 24
    assert [e["id"] for e in examples] == [r["id"] for r in tiny_pool[:24] if r["id"] not in long]
    assert clusters.tolist() == [i % 4 for i in range(24) if tiny_pool[i]["id"] not in long]
    assert [[examples[i]["id"] for i in s] for s in got] == \
        [[tiny_pool[i]["id"] for i in s if tiny_pool[i]["id"] not in long] for s in subs]


# --------------------------------------------------------------------------- training

def test_rs2_epochs_train_on_their_subsets(tmp_path, tiny_model_dir, tiny_pool, tiny_pool_path):
    """Two subsets of 16 (8 shared) over 3 epochs: subsets 0, 1, 0 (cycling); the steps are a
    fixed 16-example selection's, the distinct examples the union's 24."""
    subs = [list(range(0, 16)), list(range(8, 24))]
    sel = rs2_selection(tmp_path / "rs2.parquet", tiny_pool, subs)
    cfg = {**BASE_CFG, "epochs": 3}
    m, out = train(tmp_path, "rs2", tiny_model_dir, tiny_pool_path, sel, cfg, seed=1)
    fixed = make_selection(tmp_path / "fixed.parquet", tiny_pool, 16)
    mf, _ = train(tmp_path, "fixed", tiny_model_dir, tiny_pool_path, fixed, cfg, seed=1)
    assert m["selection_epochs"] == 2 and mf["selection_epochs"] is None
    assert m["epoch_ids_sha1"] == [sha(tiny_pool, subs[0]), sha(tiny_pool, subs[1]),
                                   sha(tiny_pool, subs[0])]
    assert mf["epoch_ids_sha1"] == [sha(tiny_pool, subs[0])] * 3
    assert m["distinct_examples"] == 24 and mf["distinct_examples"] == 16
    assert m["steps"] == mf["steps"] == math.ceil(16 / 4) * 3
    assert m["steps_per_epoch"] == mf["steps_per_epoch"] == 4
    assert m["examples"] == mf["examples"] == 16 and len(m["epoch_losses"]) == 3
    # fewer epochs than subsets: the first ones
    m1, _ = train(tmp_path, "one", tiny_model_dir, tiny_pool_path, sel, {**cfg, "epochs": 1})
    assert m1["epoch_ids_sha1"] == [sha(tiny_pool, subs[0])] and m1["distinct_examples"] == 16


def test_one_epoch_subset_trains_as_the_fixed_selection(tmp_path, tiny_model_dir, tiny_pool,
                                                        tiny_pool_path):
    """An epoch column with the single epoch 0 trains bit for bit as the same fixed subset."""
    cfg = {**BASE_CFG, "epochs": 2}
    sel = rs2_selection(tmp_path / "e.parquet", tiny_pool, [list(range(18))])
    m, a = train(tmp_path, "e", tiny_model_dir, tiny_pool_path, sel, cfg, 4, "balanced")
    fixed = make_selection(tmp_path / "f.parquet", tiny_pool, 18)
    mf, b = train(tmp_path, "f", tiny_model_dir, tiny_pool_path, fixed, cfg, 4, "balanced")
    assert m["selection_epochs"] == 1 and m["loss_curve"] == mf["loss_curve"]
    wa, wb = weights(a), weights(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_rs2_resume_inside_a_later_epoch(tmp_path, tiny_model_dir, tiny_pool, tiny_pool_path):
    """Killed after a checkpoint in epoch 1 (step 7 of 5 + 5), the rerun resumes there and
    ends on the uninterrupted run's weights; another assignment of ids to epochs does not
    resume from that checkpoint."""
    subs = [list(range(0, 20)), list(range(30, 50))]
    sel = rs2_selection(tmp_path / "sel.parquet", tiny_pool, subs)
    cfg = {**BASE_CFG, "epochs": 2, "checkpoint_every": 3}
    full, w_full = train(tmp_path, "full", tiny_model_dir, tiny_pool_path, sel, cfg, seed=2)
    assert full["steps"] == 10 and full["distinct_examples"] == 40
    part, out = train(tmp_path, "res", tiny_model_dir, tiny_pool_path, sel,
                      {**cfg, "max_steps": 7}, seed=2)
    assert part["stopped_early"] and part["steps"] == 7
    assert part["epoch_ids_sha1"][0] == sha(tiny_pool, subs[0]) and len(part["epoch_ids_sha1"]) == 2
    assert 20 < part["distinct_examples"] < 40
    ckpt = Path(str(out) + ".ckpt") / "state.pt"
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    assert (state["epoch"], state["batch"], state["step"]) == (1, 2, 7)
    done, out2 = train(tmp_path, "res", tiny_model_dir, tiny_pool_path, sel, cfg, seed=2)
    assert done["resumed_from_step"] == 7 and done["steps"] == 10 and not done["stopped_early"]
    for k in ("distinct_examples", "epoch_ids_sha1", "per_rank_tokens_per_step", "steps_per_epoch"):
        assert done[k] == full[k], k
    wf, wr = weights(w_full), weights(out2)
    assert all(torch.allclose(wf[k], wr[k], atol=1e-6) for k in wf)
    # the same ids dealt to the epochs the other way round: a different run
    part2, out3 = train(tmp_path, "swap", tiny_model_dir, tiny_pool_path, sel,
                        {**cfg, "max_steps": 7}, seed=2)
    swapped = rs2_selection(tmp_path / "swapped.parquet", tiny_pool, subs[::-1])
    with pytest.warns(UserWarning, match="different run"):
        m, _ = train(tmp_path, "swap", tiny_model_dir, tiny_pool_path, swapped, cfg, seed=2)
    assert m["resumed_from_step"] is None and m["steps"] == 10


def test_two_rank_balanced_rs2(tmp_path, tiny_model_dir, tiny_pool, tiny_pool_path):
    """2 gloo ranks, balanced sampler on each epoch's subset of 18 (ceil(18 / 8) = 3 steps)."""
    subs = [list(range(0, 18)), list(range(9, 27))]
    sel = rs2_selection(tmp_path / "sel.parquet", tiny_pool, subs)
    cfg = {**BASE_CFG, "epochs": 2}
    out, met = tmp_path / "model", tmp_path / "train_metrics.json"
    r = torchrun(2, tiny_model_dir, tiny_pool_path, sel, out, met, "balanced", 1, cfg, tmp_path,
                 threads=2)
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads(met.read_text())
    assert m["world_size"] == 2 and m["distribution"] == "balanced"
    assert m["steps"] == 6 and m["steps_per_epoch"] == 3 and m["examples"] == 18
    assert m["selection_epochs"] == 2 and m["distinct_examples"] == 27
    assert m["epoch_ids_sha1"] == [sha(tiny_pool, s) for s in subs]
    assert all(len(row) == 2 and min(row) > 0 for row in m["per_rank_tokens_per_step"])
