"""Per-example gradients of the LoRA parameters, one batched forward/backward per batch.

Why a batched pass: a batch-size-1 loop costs one training step per example; the default
``method: hook`` keeps each LoRA linear layer's input ``x`` and output ``y`` with forward
hooks, takes ``dy`` for the whole batch from one ``autograd.grad`` of the sum of the
per-example losses, and forms ``dW[b] = einsum("bto,bti->boi", dy, x)``: exact, and about
one training step for the batch (``benchmarks/bench_score.py``). ``method: func`` vmaps
``grad(functional_call)`` instead; both match the loop (``grads_loop``, tests). Each
example's gradient does not depend on its batch mates, so batches may be length-sorted.

With ``sparse_logits`` the LM head runs only at the positions that predict a response
token (the others carry no loss): the same losses and gradients up to float rounding, for
less head work. With ``score.precision: bf16`` the forward passes run under bfloat16
autocast (:func:`forward_autocast`) and the per-example gradients are formed and projected
from float32 copies of ``x`` and ``dy``, outside it. ``gradient_type: adam`` swaps the
gradient for LESS's Adam-preconditioned direction (:func:`adam_direction`) from the
warm-up optimiser's moments. With
``projection: kronecker`` the hook path projects ``x`` and ``dy`` before their product
(:func:`grads_hook_kronecker`), so no per-example ``dW`` is ever formed.
"""

from __future__ import annotations

from typing import Any, Callable

from clusterft.pipeline.errors import InputError
from clusterft.stages.score.settings import ADAM_BETAS, ADAM_EPS


def forward_autocast(model, precision: str | None):
    """The context of ``model``'s forward passes for a ``score.precision`` value: bfloat16
    autocast on the model's device for ``bf16`` (``auto``: on a CUDA GPU with bf16, else
    fp32), no context at all for ``fp32`` (or None), so an fp32 run computes exactly as it
    did before the setting existed. Backward passes run outside it (in the forward's
    dtypes); gradients are formed and projected in float32."""
    import contextlib

    from clusterft.modeling.precision import autocast, resolve_precision

    if precision in (None, "fp32"):
        return contextlib.nullcontext()
    device = next(model.parameters()).device
    if precision == "auto":  # auto never warns; an explicit bf16 warned where it was resolved
        precision = resolve_precision(precision, device, "score.precision")
    return autocast(device, precision) if precision == "bf16" else contextlib.nullcontext()


def lora_parameters(model) -> list[tuple[str, Any]]:
    """Trainable parameters in ``named_parameters`` order (the feature flattening order).

    Raises if anything but LoRA adapters requires grad (e.g. a model that was not frozen).
    """
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not params:
        raise InputError("model has no trainable (LoRA) parameters", field="score.lora.target_modules")
    other = [n for n, _ in params if "lora_" not in n]
    if other:
        raise InputError(f"non-LoRA parameters require grad: {other[:5]}", field="score")
    return params


def set_lora(model, values: dict) -> None:
    """Copy ``values`` (name -> tensor) into the LoRA parameters of ``model``."""
    import torch

    params = dict(lora_parameters(model))
    with torch.no_grad():
        for name, value in values.items():
            params[name].copy_(value)


def per_example_loss(logits, labels, normalization: str = "mean"):
    """Each example's mean next-token loss over its labelled tokens ([B]; 0 if none);
    ``normalization="sum"``: their sum (the mean times the example's label-token count)."""
    import torch.nn.functional as F

    lg, lb = logits[:, :-1], labels[:, 1:]
    tok = F.cross_entropy(lg.reshape(-1, lg.shape[-1]).float(), lb.reshape(-1),
                          ignore_index=-100, reduction="none").view(lb.shape)
    mask = (lb != -100).to(tok.dtype)
    if normalization == "sum":
        return (tok * mask).sum(1)
    return (tok * mask).sum(1) / mask.sum(1).clamp_min(1.0)


def use_sparse_logits(model, cfg: dict) -> bool:
    """Whether ``cfg["sparse_logits"]`` applies to ``model``'s architecture."""
    from clusterft.modeling.microbatch import sparse_logits_apply

    return sparse_logits_apply(model, cfg.get("sparse_logits"))


def example_losses(model, batch: dict, sparse: bool, normalization: str = "mean"):
    """Each example's :func:`per_example_loss` ([B]) under ``model``; with ``sparse`` from
    ``clusterft.modeling.microbatch.label_logits`` (the same values up to float rounding).
    ``normalization``: mean (default) or sum over the example's label tokens."""
    import torch
    import torch.nn.functional as F

    if not sparse:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       use_cache=False).logits
        return per_example_loss(logits, batch["labels"], normalization)
    from clusterft.modeling.microbatch import label_logits

    logits, target, keep = label_logits(model, batch["input_ids"], batch["attention_mask"],
                                        batch["labels"])
    tok = F.cross_entropy(logits.float(), target, reduction="none")
    count = keep.sum(1).to(tok.dtype)
    sums = torch.zeros(len(count), dtype=tok.dtype, device=tok.device)
    if normalization == "sum":
        return sums.index_add_(0, keep.nonzero()[:, 0], tok)
    return sums.index_add_(0, keep.nonzero()[:, 0], tok) / count.clamp_min(1.0)


def batch_loss(model, batch: dict, sparse: bool):
    """The batch's mean next-token loss over all its label tokens (HF's ``.loss``); with
    ``sparse`` from ``clusterft.modeling.microbatch.label_logits``."""
    import torch.nn.functional as F

    if not sparse:
        return model(**batch, use_cache=False).loss
    from clusterft.modeling.microbatch import label_logits

    logits, target, _ = label_logits(model, batch["input_ids"], batch["attention_mask"],
                                     batch["labels"])
    return F.cross_entropy(logits.float(), target)


def _check_right_padded(batch: dict) -> None:
    import torch

    am = batch["attention_mask"]
    pos = torch.arange(am.shape[1], device=am.device)[None, :]
    if not bool(((pos < am.sum(1, keepdim=True)).to(am.dtype) == am).all()):
        raise ValueError("per-example gradients need right-padded batches")


def _hook_capture(model, batch: dict, sparse: bool = False, precision: str | None = None,
                  normalization: str = "mean") -> tuple[list[tuple[str, str]], dict[str, list]]:
    """One batched forward/backward for the hook method: (plan, calls). ``plan``: (module
    name, "weight"|"bias") per trainable parameter, in parameter order; ``calls``: module
    name -> one (input x, output gradient dy) per call of the module in the forward pass.

    Every trainable parameter must be the weight (or bias) of an ``nn.Linear`` (peft LoRA
    linear adapters); anything else raises (use ``method: func``). ``sparse``: the LM head
    at the label positions only (:func:`example_losses`; the same gradients up to rounding).
    ``precision``: the forward pass under :func:`forward_autocast` (x and dy are then
    bfloat16 where autocast computed them; callers cast them to float32).
    """
    import torch

    params = lora_parameters(model)
    modules = dict(model.named_modules())
    plan: list[tuple[str, str]] = []  # (module name, "weight"|"bias") in parameter order
    for name, _ in params:
        mod_name, attr = name.rsplit(".", 1)
        mod = modules.get(mod_name)
        if not isinstance(mod, torch.nn.Linear) or attr not in ("weight", "bias"):
            raise InputError(f"method 'hook' supports LoRA linear layers only, not '{name}'; "
                             "use method: func", field="score.method")
        plan.append((mod_name, attr))
    captured: dict[str, list] = {m: [] for m, _ in plan}

    def make_hook(key: str) -> Callable:
        def hook(_mod, inputs, output):
            captured[key].append((inputs[0], output))
        return hook

    handles = [modules[m].register_forward_hook(make_hook(m)) for m in captured]
    try:
        with torch.enable_grad(), forward_autocast(model, precision):
            loss = example_losses(model, batch, sparse, normalization).sum()
    finally:
        for h in handles:
            h.remove()
    keys = [(m, i) for m in captured for i in range(len(captured[m]))]
    if not keys:
        raise RuntimeError("no LoRA layer ran in the forward pass")
    outs = [captured[m][i][1] for m, i in keys]
    gouts = dict(zip(keys, torch.autograd.grad(loss, outs)))
    return plan, {m: [(x, gouts[(m, i)]) for i, (x, _) in enumerate(captured[m])]
                  for m in captured}


def _as_3d(t):
    return t.reshape(t.shape[0], -1, t.shape[-1])


def grads_hook(model, batch: dict, sparse: bool = False, precision: str | None = None,
               normalization: str = "mean"):
    """Per-example LoRA gradients [B, D] (float32) from one batched forward/backward (hook
    method): ``dW[b] = einsum("bto,bti->boi", dy, x)`` per LoRA linear layer
    (``_hook_capture``), from float32 ``x`` and ``dy`` whatever dtype the forward ran in."""
    import torch

    plan, calls = _hook_capture(model, batch, sparse, precision, normalization)
    cols = []
    for mod_name, attr in plan:
        g = None
        for x, dy in calls[mod_name]:
            x3, dy3 = _as_3d(x).float(), _as_3d(dy).float()  # no-ops in fp32
            gi = (torch.einsum("bto,bti->boi", dy3, x3) if attr == "weight" else dy3.sum(1))
            g = gi if g is None else g + gi
        cols.append(g.reshape(g.shape[0], -1))
    return torch.cat(cols, dim=1).detach()


def grads_hook_kronecker(model, batch: dict, proj, sparse: bool = False,
                         precision: str | None = None, normalization: str = "mean"):
    """Kronecker-projected per-example LoRA gradients [B, proj.dim] (float32) from the hook
    method's captured factors: each layer's ``x`` and ``dy`` go to
    ``proj.project_layer`` (``clusterft.stages.score.projection.KroneckerProjector``), which projects
    them before their product over tokens, so no per-example [d_out, d_in] gradient is
    formed. Equal to ``proj(grads_hook(model, batch))`` up to float rounding. The factors
    are cast to float32 before their projection (``project_layer``), outside autocast."""
    import torch

    plan, calls = _hook_capture(model, batch, sparse, precision, normalization)
    parts = []
    with torch.no_grad():
        for i, (mod_name, attr) in enumerate(plan):
            block = None
            for x, dy in calls[mod_name]:
                bi = proj.project_layer(i, _as_3d(x) if attr == "weight" else None, _as_3d(dy))
                block = bi if block is None else block + bi
            parts.append(block)
        return proj.finish(parts)


def grads_func(model, batch: dict, precision: str | None = None, normalization: str = "mean"):
    """Per-example LoRA gradients [B, D] with ``torch.func.vmap(grad(functional_call))``.

    Needs right padding: each example runs without an attention mask (HF's mask code is
    data-dependent and cannot be vmapped); with causal attention, real tokens never see
    the padding that follows them, and padded positions carry no loss.
    """
    import torch
    from torch.func import functional_call, grad, vmap

    _check_right_padded(batch)
    names = [n for n, _ in lora_parameters(model)]
    values = {n: p.detach() for n, p in model.named_parameters() if n in set(names)}

    def loss_fn(p: dict, ids, labels):
        with forward_autocast(model, precision):
            out = functional_call(model, p, args=(), kwargs={"input_ids": ids[None]})
        return per_example_loss(out.logits, labels[None], normalization)[0]

    with torch.enable_grad():
        g = vmap(grad(loss_fn), in_dims=(None, 0, 0))(values, batch["input_ids"], batch["labels"])
    return torch.cat([g[n].reshape(g[n].shape[0], -1).float() for n in names], dim=1).detach()


def grads_loop(model, batch: dict, precision: str | None = None, normalization: str = "mean"):
    """Reference: per-example LoRA gradients [B, D], one unpadded example at a time."""
    import torch

    params = [p for _, p in lora_parameters(model)]
    rows = []
    lengths = batch["attention_mask"].sum(1).tolist()
    for b, length in enumerate(lengths):
        with torch.enable_grad():
            with forward_autocast(model, precision):
                logits = model(input_ids=batch["input_ids"][b:b + 1, :length]).logits
            loss = per_example_loss(logits, batch["labels"][b:b + 1, :length], normalization)[0]
            gr = torch.autograd.grad(loss, params, allow_unused=True)
        rows.append(torch.cat([(torch.zeros_like(p) if x is None else x).reshape(-1).float()
                               for x, p in zip(gr, params)]))
    return torch.stack(rows)


GRAD_FNS = {"hook": grads_hook, "func": grads_func, "loop": grads_loop}

def per_example_grads(model, batch: dict, method: str = "hook", sparse: bool = False,
                      precision: str | None = None, normalization: str = "mean"):
    """Per-example gradients [B, D] (float32) of each example's mean response loss (LoRA
    params; ``normalization="sum"``: of its summed response loss, the mean's gradient times
    the example's response-token count). ``sparse`` (hook only): the LM head at the label
    positions only; ``precision``: the forward passes' (:func:`forward_autocast`)."""
    if method not in GRAD_FNS:
        raise InputError(f"unknown method '{method}'; valid: {', '.join(GRAD_FNS)}",
                         field="score.method")
    if method == "hook":
        return grads_hook(model, batch, sparse, precision, normalization)
    return GRAD_FNS[method](model, batch, precision, normalization)


def adam_direction(g, exp_avg, exp_avg_sq):
    """LESS's Adam-preconditioned per-example direction from warm-up moments m, v."""
    b1, b2 = ADAM_BETAS
    m = b1 * exp_avg + (1 - b1) * g
    v = b2 * exp_avg_sq + (1 - b2) * g * g
    return m / (v + ADAM_EPS).sqrt()


def project_batch(model, batch: dict, cfg: dict, proj, moments=None):
    """(projected rows [B, dim] float32, grad norms [B]) of one batch.

    Dense: the per-example gradients (``cfg["method"]``), Adam directions when ``moments``
    (exp_avg, exp_avg_sq) are given, their norms and ``proj`` of them. Kronecker: with
    method hook the blocks straight from the captured factors (:func:`grads_hook_kronecker`),
    otherwise ``proj`` of the formed gradients; the norms are the projected rows' (the
    gradient is not formed; ``E|f|^2 = |g|^2``). The forward pass runs in
    ``cfg["precision"]`` (:func:`forward_autocast`); the gradients, their projection and
    norms are float32. ``cfg["loss_normalization"]``: each example's loss is the mean
    (default) or the sum over its response tokens.
    """
    sparse = use_sparse_logits(model, cfg)
    precision = cfg.get("precision", "auto")
    norm = cfg.get("loss_normalization", "mean")
    if cfg["projection"] == "kronecker":
        if moments is not None:
            raise InputError("projection 'kronecker' cannot give the Adam direction",
                             field="score.projection")
        rows = (grads_hook_kronecker(model, batch, proj, sparse, precision, norm)
                if cfg["method"] == "hook"
                else proj(per_example_grads(model, batch, cfg["method"], precision=precision,
                                            normalization=norm)))
        return rows, rows.norm(dim=1)
    g = per_example_grads(model, batch, cfg["method"], sparse, precision, norm)
    if moments is not None:
        g = adam_direction(g, *moments)
    return proj(g), g.norm(dim=1)

