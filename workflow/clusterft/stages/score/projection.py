"""The random projections of per-example gradients to ``dim`` features: the dense one
(``score.projection: rademacher | gaussian``, :class:`Projector`) and the
Kronecker-structured one (LoGra, Choe et al. 2024, ``score.projection: kronecker``,
:class:`KroneckerProjector`); :func:`make_projector` builds the one a config names.

**Dense.** A seeded [D, dim] matrix (Rademacher +-1/sqrt(dim) or Gaussian N(0, 1/dim)),
generated in fixed chunks of rows from ``numpy.random.default_rng([seed, chunk])`` so every
machine builds the same matrix, maps the flattened LoRA gradient (D values) to ``dim``
(``E|Pg|^2 = |g|^2``). Its cost grows with ``D * dim``, which is why the Kronecker form
exists:

**Kronecker.** The per-example gradient of a linear layer's weight is a sum of outer
products, ``dW = sum_t dy_t x_t^T`` [d_out, d_in] (``x``: the layer's input, ``dy``: the gradient of
its output, ``t`` over the tokens). A projection with the Kronecker structure
``P = P_out (x) P_in`` maps it to the [k_out, k_in] block

    P_out^T dW P_in = sum_t (P_out^T dy_t) (P_in^T x_t)^T,

so ``x`` [B, T, d_in] and ``dy`` [B, T, d_out] are projected FIRST (to [B, T, k_in] and
[B, T, k_out]) and only the small block is formed: time and memory per layer are
``O(B T (d_in k_in + d_out k_out))``, never ``d_out * d_in`` per example, and the random
matrices are ``d_in k_in + d_out k_out`` numbers instead of a dense ``D x dim`` matrix.

**Unbiased.** The factors have independent Rademacher +-1 entries (unit variance). Each
block entry ``e_ij = p_i^T dW q_j`` (``p_i``, ``q_j`` columns of P_out, P_in) then has
``E[e_ij(A) e_ij(B)] = <A, B>_F`` for any two gradients A, B of the layer, so keeping ``m``
entries scaled by ``1/sqrt(m)`` gives ``E[<f(A), f(B)>] = <A, B>_F``, as the dense
projection does; summed over layers, the inner product of two feature rows estimates that
of the two flattened gradients. Where a side is kept whole (identity, see below) the
entries of one row are not separately unbiased, but every row is kept and the block is
scaled by ``1/sqrt(k)`` of the random side: the same expectation.

**Dimension rule** (:func:`kronecker_plan`), deterministic, from the layer shapes (in
parameter order) and ``dim``:

1. Budgets: layer ``l`` of ``L`` gets ``b_l = floor(left / (L - l))`` entries, ``left``
   being what the layers before it left of ``dim`` (an equal share, as LoGra gives every
   layer the same size; what a layer cannot use passes on to the next). Needs
   ``dim >= L``.
2. A layer [d_out, d_in] with small side ``s = min(d_out, d_in)`` and budget ``b``:

   - ``s * s <= b`` (the balanced ``sqrt(b)`` would not compress the small side): the
     small side is kept whole (identity: exact, and free), the large side is projected to
     ``k = min(large, floor(b / s))``; ``s * k <= b`` entries. With ``k == large`` too the
     layer is so small (``d_out * d_in <= b``) that its exact gradient is the block.
   - else both sides are projected, as square as possible: the larger side to
     ``ceil(sqrt(b))``, the smaller to ``ceil(b / ceil(sqrt(b)))``; the row-major first
     ``b`` entries of the block are kept (each entry is unbiased on its own).
3. The blocks are concatenated in parameter order; what the last layer could not use is
   zero-padded (at most ``s - 1`` columns for a LoRA layer): rows are exactly ``dim``
   wide, as with the dense projection.

For LoRA (``lora_A`` [r, d_in], ``lora_B`` [d_out, r]) the small side is the rank ``r``:
with ``b >= r^2`` it is kept whole. A bias (gradient ``sum_t dy_t``) is a layer with
``d_in = 1`` (``x = 1``).

The Adam direction of LESS (``gradient_type: adam``) divides each weight's gradient
elementwise by ``sqrt(v)``: that has no Kronecker form, so it needs the whole per-example
gradient and ``clusterft.stages.score`` refuses the combination.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from clusterft.pipeline.errors import InputError
from clusterft.stages.score.gradients import lora_parameters
from clusterft.stages.score.settings import DENSE_PROJECTIONS, PROJECTION_CHUNK_ROWS

# Part of the definition of the factor matrices: layer l's P_out is drawn from
# numpy.random.default_rng([seed, KRONECKER_STREAM, l, 0]), its P_in from [..., l, 1].
KRONECKER_STREAM = 0x4B524F4E  # "KRON"


@dataclass(frozen=True)
class LayerPlan:
    """One layer's block: ``k_out`` x ``k_in`` (a side of size ``d`` with ``k == d`` and
    ``identity`` is not projected), the first ``keep`` row-major entries kept, times
    ``scale``."""

    d_out: int
    d_in: int
    k_out: int
    k_in: int
    out_identity: bool
    in_identity: bool
    keep: int
    scale: float


def layer_plan(d_out: int, d_in: int, budget: int) -> LayerPlan:
    """The block of one [d_out, d_in] layer with ``budget`` entries (rule 2 of the module
    docstring)."""
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    small_is_out = d_out <= d_in
    s, big = (d_out, d_in) if small_is_out else (d_in, d_out)
    if s * s <= budget:
        k_big = min(big, budget // s)
        k_s, s_id, big_id = s, True, k_big == big
        keep = s * k_big
        scale = 1.0 if big_id else 1.0 / math.sqrt(k_big)
    else:
        k_big = math.isqrt(budget - 1) + 1  # ceil(sqrt(budget))
        k_s = -(-budget // k_big)
        s_id = big_id = False
        keep, scale = budget, 1.0 / math.sqrt(budget)
    if small_is_out:
        return LayerPlan(d_out, d_in, k_s, k_big, s_id, big_id, keep, scale)
    return LayerPlan(d_out, d_in, k_big, k_s, big_id, s_id, keep, scale)


def kronecker_plan(shapes: Sequence[tuple[int, int]], dim: int) -> tuple[list[LayerPlan], int]:
    """(one :class:`LayerPlan` per [d_out, d_in] layer, zero columns padded at the end):
    the blocks' ``keep`` plus the padding sum to ``dim`` (rules 1-3 of the module
    docstring)."""
    n = len(shapes)
    if n == 0:
        raise ValueError("no layers to project")
    if dim < n:
        raise InputError(f"projection 'kronecker' gives every LoRA weight matrix a block of "
                         f">= 1 entry: dim must be >= their number ({n}), got {dim}",
                         field="score.dim")
    plans, left = [], int(dim)
    for i, (d_out, d_in) in enumerate(shapes):
        plan = layer_plan(int(d_out), int(d_in), left // (n - i))
        plans.append(plan)
        left -= plan.keep
    return plans, left


def rademacher(seed: int, layer: int, side: int, rows: int, cols: int) -> np.ndarray:
    """A layer's factor with unit +-1 entries (float32 [rows, cols]), from
    ``default_rng([seed, KRONECKER_STREAM, layer, side])`` (side 0: P_out, 1: P_in)."""
    rng = np.random.default_rng([seed, KRONECKER_STREAM, layer, side])
    return (rng.integers(0, 2, size=(rows, cols), dtype=np.int8) * 2 - 1).astype(np.float32)


class KroneckerProjector:
    """Seeded Kronecker-structured projection of per-example layer gradients to ``dim``.

    ``shapes``: each trainable parameter's shape in the flattening order of the gradient
    (``[d_out, d_in]`` for a weight, ``[d_out]`` for a bias). Per layer the factors are
    ``P_out`` [d_out, k_out] and ``P_in`` [d_in, k_in] (None where a side is kept whole),
    the block's ``scale`` folded into one of them.

    - :meth:`project_layer` maps one layer's factors ``x``, ``dy`` to its block without
      forming the per-example weight gradient (the hook path);
    - :meth:`__call__` maps whole flattened per-example gradients [B, D] (any method that
      forms them: func, loop) to the same features, for checks and for those methods.
    """

    def __init__(self, shapes: Sequence[Sequence[int]], dim: int, seed: int,
                 device: Any = "cpu") -> None:
        import torch

        if seed < 0:
            raise InputError(f"seed must be >= 0, got {seed}", field="seed")
        self.shapes = [tuple(int(v) for v in s) for s in shapes]
        for s in self.shapes:
            if len(s) not in (1, 2):
                raise InputError(f"projection 'kronecker' needs weight matrices or bias "
                                 f"vectors, got a parameter of shape {list(s)}",
                                 field="score.projection")
        mats = [(s[0], s[1] if len(s) == 2 else 1) for s in self.shapes]
        self.dim, self.seed, self.device = int(dim), int(seed), device
        self.plans, self.pad = kronecker_plan(mats, self.dim)
        self.d = sum(a * b for a, b in mats)
        self.p_out: list = []
        self.p_in: list = []
        for i, p in enumerate(self.plans):
            out = None if p.out_identity else rademacher(self.seed, i, 0, p.d_out, p.k_out)
            inn = None if p.in_identity else rademacher(self.seed, i, 1, p.d_in, p.k_in)
            if p.scale != 1.0:  # into a random factor (a scaled side is never the identity)
                if inn is not None:
                    inn = inn * np.float32(p.scale)
                else:
                    out = out * np.float32(p.scale)
            self.p_out.append(None if out is None else torch.from_numpy(out).to(device))
            self.p_in.append(None if inn is None else torch.from_numpy(inn).to(device))

    def blocks(self) -> list[tuple[int, int, int]]:
        """(k_out, k_in, kept entries) per layer."""
        return [(p.k_out, p.k_in, p.keep) for p in self.plans]

    def project_layer(self, i: int, x, dy):
        """Layer ``i``'s block from its factors: ``x`` [B, T, d_in] (None for a bias: ones)
        and ``dy`` [B, T, d_out] -> [B, keep] float32, ``sum_t (P_out^T dy_t)(P_in^T
        x_t)^T`` flattened: both factors are projected before the product over tokens."""
        import torch

        plan = self.plans[i]
        dyp = dy.float() if self.p_out[i] is None else dy.float() @ self.p_out[i]
        if x is None:  # a bias: d_in = 1, x_t = 1, kept whole
            block = dyp.sum(1)[:, :, None]
            if self.p_in[i] is not None:  # only if the bias is scaled on its in side
                block = block @ self.p_in[i]
        else:
            xp = x.float() if self.p_in[i] is None else x.float() @ self.p_in[i]
            block = torch.bmm(dyp.transpose(1, 2), xp)  # [B, k_out, k_in]
        return block.reshape(block.shape[0], -1)[:, :plan.keep]

    def finish(self, parts: Sequence):
        """Concatenate the layers' blocks (in layer order) and zero-pad to [B, dim]."""
        import torch

        if len(parts) != len(self.plans):
            raise ValueError(f"{len(parts)} blocks for {len(self.plans)} layers")
        if self.pad:
            parts = [*parts, parts[0].new_zeros((parts[0].shape[0], self.pad))]
        return torch.cat(list(parts), dim=1)

    def __call__(self, g):
        """Project whole flattened per-example gradients [B, D] -> [B, dim] (float32):
        each layer's slice viewed as [B, d_out, d_in] and mapped to ``P_out^T dW P_in``."""
        if g.shape[1] != self.d:
            raise ValueError(f"gradient has {g.shape[1]} columns, projector expects {self.d}")
        g = g.float()
        parts, lo = [], 0
        for i, p in enumerate(self.plans):
            w = g[:, lo:lo + p.d_out * p.d_in].reshape(g.shape[0], p.d_out, p.d_in)
            lo += p.d_out * p.d_in
            if self.p_in[i] is not None:
                w = w @ self.p_in[i]
            if self.p_out[i] is not None:
                w = self.p_out[i].T @ w
            parts.append(w.reshape(g.shape[0], -1)[:, :p.keep])
        return self.finish(parts)


class Projector:
    """Seeded dense random projection R^D -> R^dim, identical on every machine.

    Row chunk c (rows ``c*4096 ...``) of the [D, dim] float32 matrix is drawn from
    ``numpy.random.default_rng([seed, c])``: Rademacher +-1/sqrt(dim) or Gaussian
    N(0, 1/dim), so ``E|Pg|^2 = |g|^2``. Chunks are cached up to ``cache_bytes`` and
    regenerated on the fly beyond that.
    """

    def __init__(self, d: int, dim: int, seed: int, kind: str = "rademacher",
                 device: str = "cpu", cache_bytes: int = 1 << 30) -> None:
        if kind not in DENSE_PROJECTIONS:
            raise InputError(f"unknown dense projection '{kind}'; valid: "
                             f"{', '.join(DENSE_PROJECTIONS)} (kronecker: "
                             "clusterft.stages.score.projection.KroneckerProjector)",
                             field="score.projection")
        if seed < 0:
            raise InputError(f"seed must be >= 0, got {seed}", field="seed")
        self.d, self.dim, self.seed, self.kind, self.device = int(d), int(dim), int(seed), kind, device
        self.n_chunks = math.ceil(self.d / PROJECTION_CHUNK_ROWS)
        self.cache = 4 * self.d * self.dim <= cache_bytes
        self._chunks: dict[int, Any] = {}

    def chunk(self, c: int):
        """Rows ``[c*4096, min(D, (c+1)*4096))`` of the matrix as a float32 tensor."""
        import torch

        if c in self._chunks:
            return self._chunks[c]
        rows = min(self.d, (c + 1) * PROJECTION_CHUNK_ROWS) - c * PROJECTION_CHUNK_ROWS
        rng = np.random.default_rng([self.seed, c])
        scale = np.float32(1.0 / math.sqrt(self.dim))
        if self.kind == "rademacher":
            m = (rng.integers(0, 2, size=(rows, self.dim), dtype=np.int8) * 2 - 1).astype(np.float32)
        else:
            m = rng.standard_normal(size=(rows, self.dim), dtype=np.float32)
        t = torch.from_numpy(m * scale).to(self.device)
        if self.cache:
            self._chunks[c] = t
        return t

    def matrix(self):
        """The whole [D, dim] matrix (for tests and small D)."""
        import torch

        return torch.cat([self.chunk(c) for c in range(self.n_chunks)], dim=0)

    def __call__(self, g):
        """Project gradients [B, D] -> [B, dim] (float32)."""
        if g.shape[1] != self.d:
            raise ValueError(f"gradient has {g.shape[1]} columns, projector expects {self.d}")
        g = g.float()
        out = None
        for c in range(self.n_chunks):
            lo = c * PROJECTION_CHUNK_ROWS
            part = g[:, lo:lo + PROJECTION_CHUNK_ROWS] @ self.chunk(c)
            out = part if out is None else out + part
        return out


def make_projector(model, cfg: dict, seed: int, device: Any = "cpu"):
    """The projection ``cfg["projection"]`` names for ``model``'s LoRA parameters: a dense
    :class:`Projector` [D, dim], or a :class:`KroneckerProjector` over their
    shapes (in ``lora_parameters`` order)."""
    params = lora_parameters(model)
    if cfg["projection"] == "kronecker":
        return KroneckerProjector([tuple(p.shape) for _, p in params], int(cfg["dim"]), seed,
                                  device)
    return Projector(sum(p.numel() for _, p in params), int(cfg["dim"]), seed,
                     cfg["projection"], device)

