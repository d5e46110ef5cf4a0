"""This process's place in a data-parallel job (torchrun or a single process), its device,
its CPU threads, and the few collectives the training loop needs."""

from __future__ import annotations

import os
import random
import sys
from dataclasses import dataclass, field

import numpy as np

from clusterft.pipeline.errors import InputError

BACKENDS = ("auto", "gloo", "nccl")
DEVICES = ("auto", "cpu", "cuda")


def resolve_device(spec: str, field: str, local_rank: int = 0) -> str:
    """``auto`` -> this rank's CUDA device when CUDA is available, else ``cpu``; ``cuda`` ->
    this rank's CUDA device; ``cuda:N`` as given. Asking for CUDA without it is an error
    naming ``field``."""
    import torch

    spec = str(spec)
    if spec == "auto":
        return f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    if spec.startswith("cuda"):
        if not torch.cuda.is_available():
            raise InputError(f"device '{spec}' requested but CUDA is not available", field=field)
        return f"cuda:{local_rank}" if spec == "cuda" else spec
    return spec


def _cpu_device():
    import torch

    return torch.device("cpu")


@dataclass
class Dist:
    """This process's place in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: object = field(default_factory=_cpu_device)
    initialized: bool = False

    @property
    def backend(self) -> str | None:
        """The process group's backend (gloo, nccl), or None for one rank without a group."""
        if not self.initialized:
            return None
        import torch.distributed as dist

        return str(dist.get_backend())


def resolve_backend(backend: str, cuda: bool) -> str:
    """The process-group backend for `train.backend` on CUDA or CPU ranks: auto picks nccl
    with CUDA, else gloo; nccl on CPU ranks is an error (naming the key) before any work."""
    if backend == "auto":
        return "nccl" if cuda else "gloo"
    if backend == "nccl" and not cuda:
        raise InputError("backend: nccl needs CUDA ranks, but this run trains on the CPU; use "
                         "gloo or auto (or device: cuda on a GPU machine)", field="train.backend")
    return backend


def setup(device: str, backend: str) -> Dist:
    """Init the process group when launched by torchrun with more than one rank, else world 1.

    One rank trains without a process group or DDP wrapper, even under torchrun: the same
    model (DDP over one rank averages nothing), without the all-reduces of the gradients and
    of the label count at every step (tests/test_train.py checks the weights are equal)."""
    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    dev = torch.device(resolve_device(device, "train.device", local_rank))
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.set_device(dev)
    initialized = False
    if world > 1:
        name = resolve_backend(backend, cuda)
        if not dist.is_initialized():
            dist.init_process_group(backend=name)
        initialized = True
        world, rank = dist.get_world_size(), dist.get_rank()
    return Dist(rank, world, local_rank, local_world, dev, initialized)


def teardown(d: Dist) -> None:
    if d.initialized:
        import torch.distributed as dist

        dist.destroy_process_group()


def barrier(d: Dist) -> None:
    if d.initialized:
        import torch.distributed as dist

        dist.barrier()


def gather_object(d: Dist, obj) -> list:
    """``obj`` from every rank, in rank order ([obj] for one rank)."""
    if not d.initialized:
        return [obj]
    import torch.distributed as dist

    out = [None] * d.world_size
    dist.all_gather_object(out, obj)
    return out


def gather_rows(d: Dist, values: list[float]) -> list[list[float]]:
    """One row of float64 numbers from every rank, in rank order."""
    import torch

    t = torch.tensor(values, dtype=torch.float64, device=d.device)
    if not d.initialized:
        return [t.cpu().tolist()]
    import torch.distributed as dist

    gathered = [torch.zeros_like(t) for _ in range(d.world_size)]
    dist.all_gather(gathered, t)
    return torch.stack(gathered).cpu().tolist()


def mean_over_ranks(d: Dist, value: float) -> float:
    """The sum of ``value`` over the ranks divided by the world size (``value`` for one)."""
    if not d.initialized:
        return float(value)
    import torch
    import torch.distributed as dist

    n = torch.tensor([value], dtype=torch.float64, device=d.device)
    dist.all_reduce(n)
    return float(n.item()) / d.world_size


def set_threads(num_threads: int, d: Dist, job_threads: int | None = None) -> int:
    """Set torch intra-op threads per rank: ``num_threads`` if > 0; else the job's CPU
    threads on this node (``job_threads``, e.g. Snakemake's ``{threads}``) shared by its
    ranks; else (under torchrun, which forces OMP_NUM_THREADS=1) available cores / ranks on
    this node; else OMP_NUM_THREADS if set; else all available cores. At least 1."""
    import torch

    n = int(num_threads)
    if n <= 0 and job_threads:
        n = max(1, int(job_threads) // max(1, d.local_world_size))
    if n <= 0 and "TORCHELASTIC_RUN_ID" not in os.environ and os.environ.get("OMP_NUM_THREADS"):
        n = max(1, int(os.environ["OMP_NUM_THREADS"]))
    if n <= 0:
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # pragma: no cover - non-Linux
            cores = os.cpu_count() or 1
        n = max(1, cores // max(1, d.local_world_size))
    torch.set_num_threads(n)
    return n


def seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    np.random.seed(seed % (2 ** 32))
    torch.manual_seed(seed)


def die_with_launcher() -> None:
    """Under torchrun, let this rank die with its launcher (Linux PR_SET_PDEATHSIG).

    torchrun starts every rank in a session of its own, so a job killed with SIGKILL (its
    process group, e.g. a killed Snakemake run) would leave the ranks training, and rank 0
    writing the outputs, behind the back of the rerun that resumes from the checkpoint.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the launcher died before prctl took effect
        os._exit(1)
