"""Are two result trees of the same config the same? File by file: byte-identical, or equal
once the work folder path, the renamed results/benchmarks -> results/tasks folder and the wall
times are normalised away; prints the files that still differ. Used to check that a refactor
left the smoke run's outputs unchanged:

    python tests/tools/same_outputs.py WORKDIR_BEFORE WORKDIR_AFTER
"""
import hashlib, json, sys
from pathlib import Path
a, b = Path(sys.argv[1]) / "results", Path(sys.argv[2]) / "results"
VOLATILE = {"wall_time_s", "total_time_s", "mean_step_time_s", "step_times", "seconds", "train_seconds",
            "total_seconds", "warmup_seconds", "time_s", "hardware", "date", "timestamp", "start_time", "end_time", "created", "host"}
def h(p): return hashlib.sha256(p.read_bytes()).hexdigest()
def strip(o):
    if isinstance(o, dict): return {k: strip(v) for k, v in o.items() if k not in VOLATILE and not k.endswith("_s") and "time" not in k}
    if isinstance(o, list): return [strip(v) for v in o]
    return o
RENAMES = [(b"results/benchmarks", b"results/tasks")]
def mapped(r): return Path(str(r).replace("benchmarks/", "tasks/", 1) if str(r).startswith("benchmarks/") else r)
fa = {mapped(p.relative_to(a)) for p in a.rglob("*") if p.is_file()}
fb = {p.relative_to(b) for p in b.rglob("*") if p.is_file()}
print("only before:", sorted(map(str, fa - fb))[:10]); print("only after:", sorted(map(str, fb - fa))[:10])
same = diff = 0; diffs = []
for r in sorted(fa & fb):
    pb = b / r
    pa = a / r if (a / r).exists() else a / str(r).replace("tasks/", "benchmarks/", 1)
    if h(pa) == h(pb): same += 1; continue
    ok = False
    ta = pa.read_bytes().replace(str(a.parent).encode(), b"WORKDIR")
    for x, y in RENAMES: ta = ta.replace(x, y)
    tb = pb.read_bytes().replace(str(b.parent).encode(), b"WORKDIR")
    if ta == tb:
        ok = "same-after-workdir-path"
    elif r.suffix == ".json":
        try: ok = strip(json.loads(ta)) == strip(json.loads(tb)) and "same-after-dropping-times-and-workdir"
        except Exception: pass
    diff += 1; diffs.append((str(r), ok or "DIFFERENT"))
print(f"byte-identical {same}, differing {diff}")
from collections import Counter
print(Counter(k for _, k in diffs))
for d in diffs:
    if d[1] == "DIFFERENT": print("  ", *d)
