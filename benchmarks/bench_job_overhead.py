"""Fixed costs of a job, measured side by side in one run.

1. **Process exit**: a Python process that has imported torch + transformers (+ lm-eval)
   and loaded a model, exiting normally vs after ``clusterft.pipeline.runtime.freeze_for_exit()``
   (what every entry point now calls when its work is done). Seconds from the end of the
   work to the end of the process, best of ``--repeats``.
2. **One rank vs two** (with ``--workdir`` of a finished run): the same training (one epoch
   of a dataset's full selection, global batch 32) on 1 rank as a plain ``python -m
   clusterft.stages.train`` process (how the workflow starts one-GPU runs), on 1 rank under
   torchrun, and on 2 ranks under torchrun, 1 thread per rank: wall seconds of the whole
   call and core-seconds (wall x ranks), the cost Snakemake books for the job on a CPU
   machine; the three launches interleaved ``--repeats`` times, medians printed. The
   embedded default runs its accuracy sweep on 1 rank because of these ratios.

    python benchmarks/bench_job_overhead.py [--repeats 3]
    python benchmarks/bench_job_overhead.py --workdir /tmp/emb_full --dataset icd10 --size large
    python benchmarks/bench_job_overhead.py --smoke

``--smoke`` runs part 1 once each with a small model (seconds: most of it is importing
torch, transformers and lm-eval) and skips part 2 unless ``--workdir`` names a finished
run (it needs that run's base model, pool and full selection; building them is a whole
workflow run). The ratios are printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
       "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "workflow"), os.environ.get("PYTHONPATH")) if p)}

EXIT_CHILD = """
import sys, time
import torch, lm_eval.evaluator
from transformers import AutoModelForCausalLM, LlamaConfig
small = len(sys.argv) > 2 and sys.argv[2] == "smoke"
cfg = LlamaConfig(vocab_size=256 if small else 2048, hidden_size=32 if small else 192,
                  intermediate_size=64 if small else 512, num_hidden_layers=1 if small else 4,
                  num_attention_heads=4, num_key_value_heads=4)
model = AutoModelForCausalLM.from_config(cfg)
if sys.argv[1] == "freeze":
    from clusterft.pipeline.runtime import freeze_for_exit
    freeze_for_exit()
print(f"{time.time():.6f}", flush=True)
"""


def exit_seconds(mode: str, smoke: bool = False) -> float:
    p = subprocess.run([sys.executable, "-c", EXIT_CHILD, mode, "smoke" if smoke else "full"],
                       env=ENV, capture_output=True, text=True, check=True)
    end = time.time()
    return end - float(p.stdout.strip().splitlines()[-1])


def train_job(workdir: Path, dataset: str, size: str, nproc: int, out: Path,
              launcher: bool = True) -> tuple[float, dict]:
    cfg = {"epochs": 1, "global_batch_size": 32, "lr": 4e-3, "max_length": 192}
    launch = ["-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
              f"--nproc-per-node={nproc}"] if launcher else []
    cmd = [sys.executable, *launch, "-m", "clusterft.stages.train",
           "--model", str(workdir / "results" / "models" / size / "base"),
           "--pool", str(workdir / "results" / "data" / dataset / "pool.jsonl"),
           "--selection", str(workdir / "results" / "select" / dataset / size / "full-1" / "s0"
                              / "selection.parquet"),
           "--out", str(out / "model"), "--metrics", str(out / "m.json"),
           "--distribution", "balanced", "--seed", "0", "--threads", str(nproc),
           "--config", json.dumps(cfg)]
    t = time.perf_counter()
    subprocess.run(cmd, env=ENV, capture_output=True, text=True, check=True)
    return time.perf_counter() - t, json.loads((out / "m.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", type=Path, help="a finished run (for the 1 vs 2 rank rows)")
    ap.add_argument("--dataset", default="icd10")
    ap.add_argument("--size", default="large")
    ap.add_argument("--smoke", action="store_true",
                    help="part 1 once with a small model; part 2 only with --workdir")
    a = ap.parse_args()
    if a.smoke:
        a.repeats = 1

    plain = min(exit_seconds("plain", a.smoke) for _ in range(a.repeats))
    frozen = min(exit_seconds("freeze", a.smoke) for _ in range(a.repeats))
    print(f"process exit after torch+transformers+lm-eval and a {'small ' if a.smoke else ''}"
          f"model (best of {a.repeats}):\n  normal {plain:.2f} s   freeze_for_exit "
          f"{frozen:.2f} s")
    if a.workdir is None:
        print("\n(1 vs 2 ranks skipped: it needs --workdir of a finished run)")
        print(f"ratios: exit after freeze_for_exit / normal exit {frozen / plain:.2f}x")
        return
    print(f"\none epoch of {a.dataset} full, {a.size} model, global batch 32:")
    launches = (("1 rank, python", 1, False), ("1 rank, torchrun", 1, True),
                ("2 ranks, torchrun", 2, True))
    runs: dict[str, list[tuple[float, dict]]] = {name: [] for name, _, _ in launches}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.repeats):
            for name, nproc, launcher in launches:
                out = Path(tmp) / f"{name.replace(' ', '').replace(',', '')}-{i}"
                runs[name].append(train_job(a.workdir, a.dataset, a.size, nproc, out, launcher))
    rows = []
    for name, nproc, _ in launches:
        wall = statistics.median(w for w, _ in runs[name])
        loop = statistics.median(m["wall_time_s"] for _, m in runs[name])
        rows.append((name, wall, wall * nproc, loop, runs[name][0][1]["steps"]))
    print(f"  medians of {a.repeats} interleaved runs each")
    for name, wall, core_s, loop, steps in rows:
        print(f"  {name:18s} job {wall:6.1f} s  core-s {core_s:6.1f}  loop {loop:6.1f} s  "
              f"steps {steps}  overhead {wall - loop:5.1f} s")
    print("ratios:")
    print(f"  exit after freeze_for_exit / normal exit {frozen / plain:.2f}x")
    print(f"  core-seconds 1 rank (python) / 1 rank (torchrun): {rows[0][2] / rows[1][2]:.2f}x")
    print(f"  core-seconds 1 rank (python) / 2 ranks (torchrun): {rows[0][2] / rows[2][2]:.2f}x")


if __name__ == "__main__":
    main()
