"""Compare two results/ trees of the same config, e.g. one run on a CPU with native bf16 and
one on a CPU without it (or forced onto its kernels): which stage outputs are byte-identical,
and how far the numbers that are not identical lie apart, next to how far two seeds lie apart.

Float kernels differ between instruction sets (AVX2 vs AVX-512 reduction orders), so from
the first float operation on (base-model pretraining) two machines train slightly different
models; training amplifies that the way a new seed does. What the report may call a
difference must therefore exceed the cross-machine spread this measures, not just the seed
noise of one machine (`report.min_se`).

``python -m clusterft.tools.compare RESULTS_A RESULTS_B [--out FILE.md]``
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

# Stage outputs compared byte for byte: (stage label, glob under results/).
STAGE_FILES: list[tuple[str, str]] = [
    ("pools", "data/*/pool.jsonl"),
    ("labels", "data/*/labels.parquet"),
    ("task items", "tasks/*/*.jsonl"),
    ("corpus", "corpus/general.txt"),
    ("tokenizer", "models/tokenizer/tokenizer.json"),
    ("base models", "models/*/base/model.safetensors"),
    ("features", "score/**/features.npy"),
    ("clusters", "cluster/**/clusters.parquet"),
    ("selections", "select/**/selection.parquet"),
    ("fine-tuned models", "train/**/model/model.safetensors"),
    ("evaluations", "eval/**/results.json"),
]
EVAL_RE = re.compile(r"eval/(?P<cell>.+?)/s(?P<seed>\d+)/results\.json$")
SEL_RE = re.compile(r"select/(?P<cell>.+?)/s(?P<seed>\d+)/selection\.parquet$")
# Final training losses compared as relative differences: (label, glob under results/).
LOSS_FILES: list[tuple[str, str]] = [
    ("base-model pretraining", "models/*/base/pretrain_metrics.json"),
    ("fine-tuning", "train/**/train_metrics.json"),
]


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def byte_identity(a: Path, b: Path) -> list[dict[str, Any]]:
    """Per stage: files in both trees, and how many are byte-identical."""
    rows = []
    for label, pattern in STAGE_FILES:
        fa = {p.relative_to(a).as_posix(): p for p in a.glob(pattern)}
        fb = {p.relative_to(b).as_posix(): p for p in b.glob(pattern)}
        both = sorted(set(fa) & set(fb))
        same = sum(_sha(fa[k]) == _sha(fb[k]) for k in both)
        rows.append({"stage": label, "files": len(both), "identical": same,
                     "only_one_side": len(set(fa) ^ set(fb))})
    return rows


def averages(root: Path) -> dict[tuple[str, int], float]:
    """(cell, seed) -> average accuracy of every fine-tuned run's results.json."""
    out = {}
    for p in root.glob("eval/**/results.json"):
        m = EVAL_RE.search(p.relative_to(root).as_posix())
        if m:
            out[(m["cell"], int(m["seed"]))] = float(json.loads(p.read_text())["average"])
    return out


def _stats(diffs: list[float]) -> dict[str, float]:
    d = np.abs(np.asarray(diffs, dtype=float))
    if d.size == 0:
        return {"n": 0, "mean_abs": math.nan, "rms": math.nan, "max_abs": math.nan}
    return {"n": int(d.size), "mean_abs": float(d.mean()), "rms": float(np.sqrt((d ** 2).mean())),
            "max_abs": float(d.max())}


def accuracy_spread(a: Path, b: Path) -> dict[str, Any]:
    """Differences in average accuracy: the same run on the two trees (per run and per cell
    mean over seeds), and, for reference, every pair of seeds of a cell within each tree.

    The per-run SD one machine change adds is rms/sqrt(2) of the run differences (each run
    carries its own share); the same holds for seeds.
    """
    va, vb = averages(a), averages(b)
    common = sorted(set(va) & set(vb))
    runs = [va[k] - vb[k] for k in common]
    cells: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for k in common:
        cells[k[0]].append((va[k], vb[k]))
    cell_means = [float(np.mean([x for x, _ in v]) - np.mean([y for _, y in v]))
                  for v in cells.values()]
    seeds = []  # every pair of seeds of a cell, in each tree
    for v in (va, vb):
        by_cell: dict[str, dict[int, float]] = defaultdict(dict)
        for (cell, seed), x in v.items():
            by_cell[cell][seed] = x
        for s in by_cell.values():
            ks = sorted(s)
            seeds += [s[i] - s[j] for n, i in enumerate(ks) for j in ks[n + 1:]]
    worst = sorted(((abs(va[k] - vb[k]), k) for k in common), reverse=True)[:5]
    return {"runs": _stats(runs), "cell_means": _stats(cell_means), "seeds": _stats(seeds),
            "n_seeds_per_cell": max((len(v) for v in cells.values()), default=0),
            "largest": [{"run": f"{k[0]}/s{k[1]}", "a": va[k], "b": vb[k]} for _, k in worst]}


def _selected(root: Path) -> dict[tuple[str, int], frozenset[str]]:
    """(cell, seed) -> the ids a selection kept."""
    import pandas as pd

    out = {}
    for p in root.glob("select/**/selection.parquet"):
        m = SEL_RE.search(p.relative_to(root).as_posix())
        if m:
            out[(m["cell"], int(m["seed"]))] = frozenset(pd.read_parquet(p, columns=["id"])["id"].astype(str))
    return out


def _jaccard(x: frozenset[str], y: frozenset[str]) -> float:
    return len(x & y) / len(x | y) if x or y else 1.0


def _summary(v: list[float]) -> dict[str, float]:
    a = np.asarray(v, dtype=float)
    if a.size == 0:
        return {"n": 0, "mean": math.nan, "min": math.nan}
    return {"n": int(a.size), "mean": float(a.mean()), "min": float(a.min())}


def selection_overlap(a: Path, b: Path) -> dict[str, Any]:
    """Jaccard overlap of the kept ids: the same selection in both trees, and, for
    reference, two seeds of a cell within each tree (what a new seed changes). Selections
    are not byte-identical across CPUs because the features are not; this says how much
    of the kept data still agrees."""
    sa, sb = _selected(a), _selected(b)
    same = [_jaccard(sa[k], sb[k]) for k in sorted(set(sa) & set(sb))]
    seeds = []
    for sel in (sa, sb):
        by_cell: dict[str, dict[int, frozenset[str]]] = defaultdict(dict)
        for (cell, seed), ids in sel.items():
            by_cell[cell][seed] = ids
        for s in by_cell.values():
            ks = sorted(s)
            seeds += [_jaccard(s[i], s[j]) for n, i in enumerate(ks) for j in ks[n + 1:]]
    return {"same": _summary(same), "seeds": _summary(seeds)}


def loss_spread(a: Path, b: Path) -> list[dict[str, Any]]:
    """Per training kind: relative difference of the same run's final loss in both trees."""
    rows = []
    for label, pattern in LOSS_FILES:
        fa = {p.relative_to(a).as_posix(): p for p in a.glob(pattern)}
        fb = {p.relative_to(b).as_posix(): p for p in b.glob(pattern)}
        rel = []
        for k in sorted(set(fa) & set(fb)):
            la = json.loads(fa[k].read_text()).get("final_loss")
            lb = json.loads(fb[k].read_text()).get("final_loss")
            if la is not None and lb is not None and (la or lb):
                rel.append(abs(la - lb) / max(abs(la), abs(lb)))
        r = np.asarray(rel, dtype=float)
        rows.append({"kind": label, "n": int(r.size),
                     "mean_rel": float(r.mean()) if r.size else math.nan,
                     "max_rel": float(r.max()) if r.size else math.nan})
    return rows


def compare(a: str | Path, b: str | Path) -> dict[str, Any]:
    a, b = Path(a), Path(b)
    for p in (a, b):
        if not p.is_dir():
            raise SystemExit(f"error: {p} is not a results folder")
    return {"a": str(a), "b": str(b), "files": byte_identity(a, b),
            "selections": selection_overlap(a, b), "losses": loss_spread(a, b),
            "accuracy": accuracy_spread(a, b)}


def render(res: dict[str, Any]) -> str:
    lines = [f"# {res['a']} vs {res['b']}", "", "| stage | files | byte-identical |",
             "| --- | --- | --- |"]
    for r in res["files"]:
        extra = f" ({r['only_one_side']} on one side only)" if r["only_one_side"] else ""
        lines.append(f"| {r['stage']} | {r['files']} | {r['identical']}{extra} |")
    so = res["selections"]
    lines += ["", "| kept ids, Jaccard overlap | n | mean | min |", "| --- | --- | --- | --- |"]
    for key, what in (("same", "same selection, A vs B"), ("seeds", "seed i vs seed j of a cell (both trees)")):
        s = so[key]
        lines.append(f"| {what} | {s['n']} | {s['mean']:.3f} | {s['min']:.3f} |")
    lines += ["", "| final loss, same run, A vs B | n | mean relative difference | max |",
              "| --- | --- | --- | --- |"]
    for r in res["losses"]:
        lines.append(f"| {r['kind']} | {r['n']} | {r['mean_rel']:.2e} | {r['max_rel']:.2e} |")
    acc = res["accuracy"]
    lines += ["", "| average accuracy difference | n | mean abs | rms | max abs | SD per run (rms/√2) |",
              "| --- | --- | --- | --- | --- | --- |"]
    for key, what in (("runs", "same run, A − B"), ("cell_means", "seed mean of a cell, A − B"),
                      ("seeds", "seed i − seed j of a cell (both trees)")):
        s = acc[key]
        sd = s["rms"] / math.sqrt(2) if s["n"] else math.nan
        lines.append(f"| {what} | {s['n']} | {s['mean_abs']:.4f} | {s['rms']:.4f} | "
                     f"{s['max_abs']:.4f} | {sd:.4f} |")
    lines += ["", "Largest run differences: " + "; ".join(
        f"{x['run']} {x['a']:.3f} vs {x['b']:.3f}" for x in acc["largest"]), ""]
    return "\n".join(lines)


def add_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """compare's flags, on its own parser and on `clusterft compare` alike."""
    ap.add_argument("a", help="results/ folder of run A")
    ap.add_argument("b", help="results/ folder of run B")
    ap.add_argument("--out", help="also write the markdown here (a .md file path)")
    ap.add_argument("--json", help="also write the numbers as JSON here (a .json file path)")
    return ap


def build_parser(prog: str = "python -m clusterft.tools.compare") -> argparse.ArgumentParser:
    return add_arguments(argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0],
                                                 allow_abbrev=False))


def main(argv: list[str] | None = None) -> int:
    return run_args(build_parser().parse_args(argv))


def run_args(args: argparse.Namespace) -> int:
    """Print (and write) the comparison of parsed `add_arguments` flags; the exit status."""
    res = compare(args.a, args.b)
    text = render(res)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
