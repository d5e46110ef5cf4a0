"""Pilot of the cipher testbed (docs/testbed.md): full data, random and oracle ONLY.

The testbed's parameters are fixed from this pilot before the method ever runs on it (the
method, clustering and every other selection are deliberately absent here). For each pool
shape it builds the cipher pool (clusterft.pools.cipher), selects full / random 31% /
oracle 31% (the method's uniform quotas on the TRUE ciphers: clusterft.stages.select), trains
the embedded default's small base model with the suite's own train loop and config, and
scores the held-out items by greedy decoding + exact match (what lm-eval's generate_until
task computes, without its start-up cost).

Two protocols per arm: `epochs` (the paper's: same epochs, so 31% takes 31% of the steps)
and `steps` (every arm trained for full's number of steps: data vs compute).

    python benchmarks/testbed_pilot.py --model results/models/small/base \
        --shape n=6000,n_words=16,words_per_example=3,zipf_s=1.2 --seeds 0 --out pilot.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def parse_shape(text: str) -> dict:
    out = {}
    for kv in text.split(","):
        k, v = kv.split("=")
        out[k] = float(v) if "." in v else int(v)
    return out


def information_bound(shape: dict, seeds, budget: float, data_seed: int) -> dict:
    """Macro exact match a model would reach if it learnt exactly the word images its
    selection shows (an item counts only when every word of its tuple appeared in an input
    of its cipher), per arm: mean and sd over the selection seeds. No training: it says
    whether a shape poses a data question at all (if random's bound is 1.0, no selection
    can add information)."""
    from clusterft.pools import cipher
    from clusterft.stages import select as sel

    built = cipher.build(dict(shape), seed=data_seed)
    labs = np.array(built.labels)
    keys, truth = np.unique(labs, return_inverse=True)
    ids = np.array([r["id"] for r in built.records])
    inputs = [r["messages"][-2]["content"].split(": ", 1)[1].split() for r in built.records]
    tests = [(it["group"], it["prompt"].split(": ", 1)[1].split("\n")[0].split())
             for it in built.items[cipher.TASK]]
    out = {}
    for arm in ("random", "oracle", "full"):
        accs = []
        for seed in seeds:
            rows = sel.select(ids, truth, None, {"oracle": "cluster"}.get(arm, arm),
                              1.0 if arm == "full" else budget, seed=seed)
            seen = {k: set() for k in keys}
            for r in rows:
                seen[labs[r]].update(inputs[r])
            per: dict[str, list[bool]] = {}
            for key, ws in tests:
                per.setdefault(key, []).append(all(w in seen[key] for w in ws))
            accs.append(np.mean([np.mean(v) for v in per.values()]))
        out[arm] = {"mean": round(float(np.mean(accs)), 3), "sd": round(float(np.std(accs)), 3)}
    out["skill_counts"] = built.extra["skill_counts"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="results/models/small/base")
    ap.add_argument("--shape", action="append", required=True,
                    help="cipher settings k=v,... (repeatable: one pool shape each)")
    ap.add_argument("--arms", default="full,random,oracle")
    ap.add_argument("--protocols", default="epochs,steps")
    ap.add_argument("--budget", type=float, default=0.31)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--data-seed", type=int, default=0)
    ap.add_argument("--train", default="{}", help="train section overrides (JSON)")
    ap.add_argument("--distribution", default="balanced",
                    help="how each step's examples are dealt (balanced: every step a mix of "
                         "the selection's clusters, here the true ciphers; random)")
    ap.add_argument("--bound", action="store_true",
                    help="print each shape's information bound (no training) and stop")
    ap.add_argument("--out", help="JSONL of results (appended; needed unless --bound)")
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.bound:
        for shape_text in args.shape:
            print(shape_text, json.dumps(information_bound(
                parse_shape(shape_text), seeds, args.budget, args.data_seed)), flush=True)
        return 0
    if not args.out:
        ap.error("--out is needed to train")

    from clusterft.modeling.distributed import setup
    from clusterft.modeling.generate import score_items
    from clusterft.pools import cipher
    from clusterft.pipeline.io import write_jsonl
    from clusterft.stages import select as sel
    from clusterft.stages.train import load_model, load_selection, train_config, train_loop
    from transformers import AutoTokenizer
    import pandas as pd

    cfg_train = train_config({"finetune": "full", "epochs": 3, "global_batch_size": 32,
                              "lr": 4.0e-3, "max_length": 192, **json.loads(args.train)})
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    d = setup("cpu", "gloo")
    for shape_text in args.shape:
        shape = parse_shape(shape_text)
        built = cipher.build(dict(shape), seed=args.data_seed)
        items = built.items[cipher.TASK]
        tmp = Path(tempfile.mkdtemp(prefix="pilot-"))
        write_jsonl(tmp / "pool.jsonl", built.records)
        ids = np.array([r["id"] for r in built.records])
        truth = np.unique(np.array(built.labels), return_inverse=True)[1]
        n = len(ids)
        full_steps = cfg_train["epochs"] * math.ceil(n / cfg_train["global_batch_size"])
        for seed in seeds:
            for arm in args.arms.split(","):
                method = {"oracle": "cluster"}.get(arm, arm)
                rows = sel.select(ids, truth, None, method, 1.0 if arm == "full" else args.budget,
                                  seed=seed)
                path = tmp / f"{arm}-{seed}.parquet"
                pd.DataFrame({"id": ids[rows], "cluster": truth[rows],
                              "score": np.zeros(len(rows))}).to_parquet(path)
                for protocol in args.protocols.split(","):
                    if arm == "full" and protocol == "steps":
                        continue  # the same run as full under epochs
                    cfg = dict(cfg_train)
                    if protocol == "steps":
                        per_epoch = math.ceil(len(rows) / cfg["global_batch_size"])
                        cfg["epochs"] = math.ceil(full_steps / per_epoch)
                        cfg["max_steps"] = full_steps
                    examples, clusters, _, subsets = load_selection(tokenizer, tmp / "pool.jsonl",
                                                                    path, cfg)
                    model = load_model(args.model, cfg, d.device)
                    t0 = time.perf_counter()
                    m = train_loop(model, tokenizer, examples, clusters, cfg, d, args.distribution,
                                   seed)
                    wall = time.perf_counter() - t0
                    scored = score_items(model, tokenizer, items, max_new_tokens=8)
                    acc, per, per_word = scored["exact"], scored["per_group"], scored["per_group_word"]
                    counts = np.bincount(truth[rows], minlength=truth.max() + 1)
                    rec = {"shape": shape, "arm": arm, "protocol": protocol, "seed": seed,
                           "distribution": args.distribution, "model": args.model,
                           "n_selected": int(len(rows)), "steps": m["steps"],
                           "train_s": round(wall, 1), "acc": round(acc, 4),
                           "macro": round(float(np.mean(list(per.values()))), 4),
                           "per_skill": {k: round(v, 3) for k, v in per.items()},
                           "word_macro": round(float(np.mean(list(per_word.values()))), 4),
                           "per_skill_word": {k: round(v, 3) for k, v in per_word.items()},
                           "min_skill_examples": int(counts.min()),
                           "final_loss": m.get("final_loss")}
                    print(json.dumps({k: v for k, v in rec.items() if not k.startswith("per_skill")}),
                          flush=True)
                    with open(args.out, "a") as f:
                        f.write(json.dumps(rec) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
