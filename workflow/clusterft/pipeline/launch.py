"""The command that starts a train job's ranks: one process, torchrun on one node, or one
torchrun agent per node of a SLURM allocation meeting at a c10d rendezvous.

The train rule calls :func:`launcher_shell` (what ``snakemake -n -p`` prints); everything
it needs to know at run time, the allocation's first node, comes from
``python -m clusterft.pipeline.launch endpoint``. :func:`launch_args` builds the same command from a
given SLURM environment (tests/test_train_scale.py checks it word for word)::

    one rank       python
    one node       torchrun --standalone --nnodes 1 --nproc-per-node G
    N nodes        srun --nodes=N --ntasks=N --ntasks-per-node=1 --cpus-per-task=G
                     --kill-on-bad-exit=1 [--gpus-per-node=G] torchrun --nnodes N
                     --nproc-per-node G --rdzv-backend c10d --rdzv-endpoint HEAD:PORT
                     --rdzv-id JOB_ID

srun starts one task per node; each runs a torchrun agent that starts G ranks. The agents
meet on the first node of ``SLURM_JOB_NODELIST`` (SLURM's compressed host list,
:func:`parse_hostlist`) at a port derived from the job id (:func:`rdzv_port`), so two
jobs whose first node is the same do not collide.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Mapping

from clusterft.pipeline.errors import InputError

FIELD = "train.gpus_per_node"
# What the train rule puts where the rendezvous endpoint goes: resolved inside the job.
ENDPOINT_VAR = "CLUSTERFT_RDZV"


def train_layout(gpus: int, gpus_per_node: int | None) -> tuple[int, int]:
    """(nodes, ranks per node) for a job of ``gpus`` ranks: all on one node when
    ``gpus_per_node`` is 0/None or at least ``gpus``, else ``gpus / gpus_per_node`` nodes
    (it must divide: every node runs the same number of ranks)."""
    gpus, per = int(gpus), int(gpus_per_node or 0)
    if gpus < 1:
        raise InputError(f"a train job needs at least 1 GPU, got {gpus}", field="gpus")
    if per < 0 or isinstance(gpus_per_node, bool):
        raise InputError(f"gpus_per_node must be an integer >= 0 (0: one node), got "
                         f"{gpus_per_node!r}", field=FIELD)
    if per == 0 or per >= gpus:
        return 1, gpus
    if gpus % per:
        raise InputError(f"{gpus} GPUs do not split evenly into nodes of gpus_per_node = {per}; "
                         "use a GPU count that is a multiple of it", field=FIELD)
    return gpus // per, per


def job_resources(gpus: int, gpus_per_node: int | None = 0, gpu: bool = False) -> dict:
    """The train rule's per-job values: ``ranks_per_node`` (threads and memory are per node),
    ``gpu`` (the single-node ``--gpus=N`` request), and for several nodes the SLURM
    executor's ``nodes``, ``tasks`` (one per node), ``mpi: srun`` (the job step runs the
    command as it is, which starts its own srun), ``gres: gpu:P`` (GPUs per node) and
    ``tasks_per_gpu: 0`` (no ``--ntasks-per-gpu``); None leaves a resource unset."""
    nodes, per = train_layout(gpus, gpus_per_node)
    multi = nodes > 1
    return {"ranks_per_node": per, "gpu": int(gpus) if gpu and not multi else 0,
            "nodes": nodes if multi else None, "tasks": nodes if multi else None,
            "mpi": "srun" if multi else None, "gres": f"gpu:{per}" if multi and gpu else None,
            "tasks_per_gpu": 0 if multi and gpu else None}


def parse_hostlist(spec: str) -> list[str]:
    """Expand SLURM's compressed host list (``SLURM_JOB_NODELIST``), as ``scontrol show
    hostnames`` does: ``gpu[01-03,07],login1`` -> gpu01 gpu02 gpu03 gpu07 login1; ranges
    keep their zero padding; several bracket groups in one name expand as a product
    (``r[1-2]n[1-2]`` -> r1n1 r1n2 r2n1 r2n2)."""
    spec = spec.strip()
    if not spec:
        raise ValueError("empty host list")
    names, depth, start = [], 0, 0
    for i, ch in enumerate(spec):  # split on commas outside brackets
        depth += ch == "["
        depth -= ch == "]"
        if depth < 0:
            raise ValueError(f"unbalanced ']' in host list {spec!r}")
        if ch == "," and depth == 0:
            names.append(spec[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced '[' in host list {spec!r}")
    names.append(spec[start:])
    out: list[str] = []
    for name in names:
        if not name:
            raise ValueError(f"empty host name in host list {spec!r}")
        out += _expand(name, spec)
    return out


def _expand(name: str, spec: str) -> list[str]:
    m = re.search(r"\[([^\[\]]*)\]", name)
    if m is None:
        return [name]
    head, tail = name[:m.start()], name[m.end():]
    values: list[str] = []
    for part in m.group(1).split(","):
        r = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if r is None:
            raise ValueError(f"bad range {part!r} in host list {spec!r}")
        lo, hi = r.group(1), r.group(2) or r.group(1)
        if int(hi) < int(lo):
            raise ValueError(f"descending range {part!r} in host list {spec!r}")
        values += [str(v).zfill(len(lo)) for v in range(int(lo), int(hi) + 1)]
    return [head + v + rest for v in values for rest in _expand(tail, spec)]


def rdzv_port(job_id: str | int, base: int = 29500, span: int = 10000) -> int:
    """The rendezvous port of SLURM job ``job_id``: ``base + job_id mod span`` (29500-39499),
    the same on every node of the job and different for jobs sharing a first node."""
    digits = re.sub(r"\D", "", str(job_id))  # array jobs: 123_4
    if not digits:
        raise ValueError(f"SLURM job id {job_id!r} has no digits")
    return base + int(digits) % span


def slurm_rendezvous(env: Mapping[str, str], nodelist: str | None = None) -> tuple[str, str]:
    """(endpoint ``host:port``, rendezvous id) of the SLURM job described by ``env``
    (``SLURM_JOB_ID``; ``SLURM_JOB_NODELIST`` unless ``nodelist`` is given)."""
    job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job:
        raise InputError("a multi-node train job must run inside a SLURM allocation "
                         "(SLURM_JOB_ID is not set); run on one node (gpus_per_node: 0) "
                         "or submit with the SLURM profile", field=FIELD)
    nodes = nodelist or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodes:
        raise InputError(f"SLURM job {job}: no SLURM_JOB_NODELIST to find the first node in",
                         field=FIELD)
    return f"{parse_hostlist(nodes)[0]}:{rdzv_port(job)}", str(job)


def torchrun_args(nodes: int, nproc_per_node: int, endpoint: str | None = None,
                  rdzv_id: str | None = None) -> list[str]:
    """torchrun's launcher arguments: standalone on one node, else a c10d rendezvous at
    ``endpoint`` (``host:port``) under ``rdzv_id``."""
    if nodes == 1:
        return ["torchrun", "--standalone", "--nnodes", "1", "--nproc-per-node", str(nproc_per_node)]
    if not endpoint or not rdzv_id:
        raise ValueError("a multi-node torchrun needs a rendezvous endpoint and id")
    return ["torchrun", "--nnodes", str(nodes), "--nproc-per-node", str(nproc_per_node),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", rdzv_id]


def launch_args(gpus: int, gpus_per_node: int | None = 0, endpoint: str | None = None,
                rdzv_id: str | None = None, gpu: bool = False) -> list[str]:
    """The words before ``-m clusterft.stages.train``: ``python`` for one rank (no launcher, no
    process group), torchrun for one node, srun + torchrun for several (one agent per node,
    ``--gpus-per-node`` when the ranks use GPUs)."""
    nodes, per = train_layout(gpus, gpus_per_node)
    if nodes == 1 and per == 1:
        return ["python"]
    run = torchrun_args(nodes, per, endpoint, rdzv_id)
    if nodes == 1:
        return run
    srun = ["srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1",
            f"--cpus-per-task={per}", "--kill-on-bad-exit=1"]
    return srun + ([f"--gpus-per-node={per}"] if gpu else []) + run


def launcher_shell(gpus: int, gpus_per_node: int | None = 0, gpu: bool = False) -> str:
    """:func:`launch_args` as the train rule's shell text; for several nodes the endpoint is
    found inside the job (``python -m clusterft.pipeline.launch endpoint``, which fails the job
    outside SLURM) and the rendezvous id is ``$SLURM_JOB_ID``."""
    nodes, _ = train_layout(gpus, gpus_per_node)
    if nodes == 1:
        return shlex.join(launch_args(gpus, gpus_per_node, gpu=gpu))
    words = launch_args(gpus, gpus_per_node, "@ENDPOINT@", "@ID@", gpu=gpu)
    text = shlex.join(words).replace("@ENDPOINT@", f'"${ENDPOINT_VAR}"').replace(
        "@ID@", '"$SLURM_JOB_ID"')
    return f"{ENDPOINT_VAR}=$(python -m clusterft.pipeline.launch endpoint) && {text}"


def job_nodelist(job_id: str) -> str:
    """The node list of a running SLURM job, from squeue (Snakemake's SLURM job step drops
    ``SLURM_JOB_NODELIST`` from the environment of the command it runs)."""
    out = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%N"], capture_output=True,
                         text=True, timeout=60, check=True).stdout.strip()
    if not out:
        raise InputError(f"squeue lists no nodes for SLURM job {job_id}", field=FIELD)
    return out.splitlines()[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m clusterft.pipeline.launch",
                                 description="print a train job's launch details",
                                 allow_abbrev=False)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("endpoint", allow_abbrev=False, help="host:port of this SLURM job's c10d rendezvous")
    cmd = sub.add_parser("command", allow_abbrev=False, help="the launcher words for a job (under SLURM: resolved)")
    cmd.add_argument("--gpus", type=int, required=True, help="ranks (GPUs) of the job in all")
    cmd.add_argument("--gpus-per-node", type=int, default=0,
                     help="ranks per node; 0: all on one node (default 0)")
    cmd.add_argument("--gpu", action="store_true", help="ranks use GPUs (srun --gpus-per-node)")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "endpoint":
            env = os.environ
            job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
            nodelist = None
            if job and not (env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")):
                nodelist = job_nodelist(job)
            print(slurm_rendezvous(env, nodelist)[0])
        else:
            nodes, _ = train_layout(args.gpus, args.gpus_per_node)
            endpoint = rdzv = None
            if nodes > 1 and os.environ.get("SLURM_JOB_ID"):
                endpoint, rdzv = slurm_rendezvous(os.environ)
            if nodes > 1 and endpoint is None:
                print(launcher_shell(args.gpus, args.gpus_per_node, args.gpu))
            else:
                print(shlex.join(launch_args(args.gpus, args.gpus_per_node, endpoint, rdzv,
                                             args.gpu)))
    except (InputError, ValueError, subprocess.SubprocessError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
