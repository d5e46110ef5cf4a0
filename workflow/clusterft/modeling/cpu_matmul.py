"""Which kernel computes a float32 ``nn.Linear`` on the CPU: ATen's (MKL's sgemm) or oneDNN's.

Why this exists: torch's CPU build hands a float32 linear layer to MKL's sgemm, and MKL picks
its kernels by the CPU's *vendor*: on AMD processors it runs its AVX2 code even where the
CPU executes AVX-512 at full width. oneDNN, which ships inside the same torch build (the
``mkldnn._linear_pointwise`` op that torch's inductor uses for CPU linears), picks its
kernels by *instruction set*. On 2 cores of an AMD EPYC with Zen 5 instructions the
linear products of the embedded default's models ran 1.65-2.23x faster through oneDNN, and
one of them 1.25x with oneDNN capped at AVX2 (``ONEDNN_MAX_CPU_ISA=AVX2``, what an AVX2-only AMD CPU
would get); whole steps gain less, because attention, norms and elementwise ops keep their
kernels (``benchmarks/bench_matmul.py``; figures in benchmarks/README.md).

Exactness: both kernels multiply float32 and accumulate in float32; they add the products
in another order, so results differ at float rounding, as the same run on another CPU does
(tests bound the difference). Each is deterministic, and a row's result does not depend on
the other rows of its matrix, so a batch and its examples one by one give the same bits
(what score's shards and the tests of the per-example gradients rely on). The kernel is
therefore chosen per process, never per product: a size threshold (ATen for small
products, whose call overhead oneDNN does not win back) was tried and dropped, because a row
would then round differently in a small batch than in a large one. The price: the
smallest steps lose (practice's steps of 8 cipher examples of a few tokens on 2 threads ran
0.77x ATen's speed; benchmarks/README.md).

The choice is process-wide, like ``torch.set_num_threads``: :func:`install` replaces
``torch.nn.Linear.forward`` with one that sends float32 CPU inputs to oneDNN (forward and
both backward products) and everything else (CUDA, bf16 autocast, other dtypes, torch.func
transforms, torch.compile) to the original. The stages call :func:`from_env` before they
build or load a model; ``CLUSTERFT_CPU_MATMUL`` (``auto`` | ``aten`` | ``onednn``) carries
the config's ``cpu_matmul`` to every job (``workflow/rules/common.smk``) and lets a user of
the command line choose. ``auto`` takes oneDNN on AMD x86 CPUs, where it was measured
faster, and ATen elsewhere: on Intel CPUs MKL runs its AVX-512 kernels (not measured against
oneDNN here), on Arm torch's build has other kernels. Subclasses of ``nn.Linear`` with a
``forward`` of their own keep it.
"""

from __future__ import annotations

import os

from clusterft.pipeline import hardware
from clusterft.pipeline.errors import InputError

MODES = ("auto", "aten", "onednn")
ENV = "CLUSTERFT_CPU_MATMUL"

_state: dict = {"mode": None, "original": None}


def choose(mode: str, vendor: str | None = None, machine: str | None = None,
           available: bool | None = None, field: str = "cpu_matmul") -> str:
    """The kernel ``mode`` means on this machine: ``aten`` or ``onednn``.

    ``auto``: oneDNN on an AMD x86 CPU (``vendor`` as /proc/cpuinfo's vendor_id), ATen
    elsewhere; an explicit ``onednn`` where torch lacks the op is refused (``available``:
    whether it has it; asked of torch when None)."""
    if mode not in MODES:
        raise InputError(f"unknown CPU matmul kernel '{mode}' ({'|'.join(MODES)})", field=field)
    if mode == "aten":
        return "aten"
    if available is None:
        available = onednn_available()
    if mode == "onednn":
        if not available:
            raise InputError("this torch build has no oneDNN linear (torch.ops.mkldnn."
                             "_linear_pointwise); set it to aten or auto", field=field)
        return "onednn"
    vendor = hardware.cpu_vendor() if vendor is None else vendor
    machine = hardware.machine() if machine is None else machine
    amd_x86 = vendor == "AuthenticAMD" and machine in ("x86_64", "AMD64")
    return "onednn" if amd_x86 and available else "aten"


def onednn_available() -> bool:
    """Whether this torch build can run a float32 linear through oneDNN."""
    import torch

    try:
        return bool(torch.backends.mkldnn.is_available()
                    and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
    except (AttributeError, RuntimeError):
        return False


def from_env(default: str = "auto") -> str:
    """:func:`install` the kernel ``CLUSTERFT_CPU_MATMUL`` names (``default`` when unset);
    returns the kernel in use. An unknown value stops with an error naming the variable."""
    return install(os.environ.get(ENV, "").strip() or default, field=ENV)


def install(mode: str = "auto", field: str = "cpu_matmul") -> str:
    """Make ``torch.nn.Linear`` compute float32 CPU products with the kernel ``mode`` resolves
    to (:func:`choose`) for the rest of the process; returns it (``aten`` | ``onednn``).
    Calling it again with another mode switches; :func:`uninstall` restores torch's."""
    import torch

    kernel = choose(mode, field=field)
    if _state["original"] is None:
        _state["original"] = torch.nn.Linear.forward
    torch.nn.Linear.forward = _state["original"] if kernel == "aten" else _onednn_forward
    _state["mode"] = kernel
    return kernel


def uninstall() -> None:
    """Put torch's own ``nn.Linear.forward`` back (tests)."""
    import torch

    if _state["original"] is not None:
        torch.nn.Linear.forward = _state["original"]
    _state["mode"] = None


def active() -> str:
    """The kernel float32 CPU linears use in this process now: ``aten`` or ``onednn``."""
    return _state["mode"] or "aten"


def _onednn_forward(self, input):
    w, b = self.weight, self.bias
    if _eligible(input, w, b):
        return _linear_function().apply(input, w, b)
    return _state["original"](self, input)


def _eligible(x, w, b) -> bool:
    """Plain float32 CPU tensors outside autocast, torch.func transforms and compilation:
    what oneDNN's float32 linear computes as defined."""
    import torch

    if x.numel() == 0:
        return False
    f32 = torch.float32
    if x.dtype != f32 or w.dtype != f32 or x.device.type != "cpu" or w.device.type != "cpu":
        return False
    if b is not None and (b.dtype != f32 or b.device.type != "cpu"):
        return False
    if x.layout != torch.strided or w.layout != torch.strided or x.shape[-1] != w.shape[1]:
        return False
    if torch.is_autocast_enabled("cpu") or torch.compiler.is_compiling():
        return False
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    return not (wrapped(x) or wrapped(w) or (b is not None and wrapped(b)))


_FUNCTION: list = []


def _linear_function():
    """The autograd function (made once, on first use, so that importing this module does
    not import torch)."""
    if _FUNCTION:
        return _FUNCTION[0]
    import torch
    from torch.autograd.function import once_differentiable

    op = torch.ops.mkldnn._linear_pointwise

    def product(a, b, bias=None):  # a @ b.T (+ bias); a and b may be transposed views
        return op(a, b, bias, "none", [], "")

    class OneDNNLinear(torch.autograd.Function):
        """y = x W^T + b through oneDNN; backward: dx = dy W, dW = dy^T x, db = sum dy."""

        @staticmethod
        def forward(ctx, x, w, b):
            x2 = x.reshape(-1, x.shape[-1])
            ctx.save_for_backward(x2, w)
            ctx.shape, ctx.has_bias = x.shape, b is not None
            return product(x2, w, b).view(*x.shape[:-1], w.shape[0])

        @staticmethod
        @once_differentiable
        def backward(ctx, grad):
            x2, w = ctx.saved_tensors
            g2 = grad.reshape(-1, grad.shape[-1])
            dx = dw = db = None
            if ctx.needs_input_grad[0]:
                dx = product(g2, w.t()).view(ctx.shape)
            if ctx.needs_input_grad[1]:
                dw = product(g2.t(), x2.t())
            if ctx.has_bias and ctx.needs_input_grad[2]:
                db = g2.sum(0)
            return dx, dw, db

    _FUNCTION.append(OneDNNLinear)
    return OneDNNLinear


__all__ = ["MODES", "ENV", "choose", "onednn_available", "from_env", "install", "uninstall",
           "active"]
