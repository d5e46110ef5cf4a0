"""Padding-free micro-batches: a rank's step examples packed into one row.

The step's examples are concatenated into a single row of ``sum(lengths)`` tokens
(:func:`pack_examples`): position ids restart at 0 with every example (so RoPE sees what
it sees in a padded row), the label of each example's first token is -100 (the last token
of the example before it must not learn to predict it; in a padded row nothing predicts a
first token either), and attention stays inside each example. The per-token work (the
embedding, every projection and MLP, the norms, the LM head) then runs on real tokens only;
only attention, whose cost is per example, needs the boundaries.

Attention inside each example, three ways were measured on the CPU (benchmarks/README.md,
"Packed micro-batches"):

* transformers' own packed detection (``position_ids`` that restart, no attention mask)
  with ``sdpa``, or an explicit block-diagonal causal 4D mask: exact, but one
  ``[T, T]`` attention over the whole row, 2x slower than the padded step at 16 examples;
* ``flex_attention``: torch 2.13 has no backward for it on the CPU;
* :func:`varlen_sdpa_attention`, registered here as the attention implementation
  :data:`PACKED_ATTN`: the row's examples are gathered into a few length-grouped padded
  blocks (:func:`clusterft.modeling.microbatch.plan_micro_batches` on their lengths) and
  each block runs ``scaled_dot_product_attention(is_causal=True)``: exact (a right-padded
  block under a causal mask never lets a real query see a padded key, and padded queries'
  outputs are dropped), and the fastest. Padding is left only inside attention.

On a CUDA GPU with flash-attn installed, ``flash_attention_2`` is used instead: its varlen
kernels take the same ``cu_seq_lens`` (:func:`forward_kwargs`; not tested here, no GPU).

A call without a plan (no packing: an evaluation, a padded batch) runs plain ``sdpa`` with
its usual mask, so a model left on :data:`PACKED_ATTN` behaves as under ``sdpa``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from clusterft.modeling.tokenize import IGNORE_INDEX

PACKED_ATTN = "clusterft_varlen_sdpa"
FLASH_ATTN = "flash_attention_2"
# Architectures whose attention goes through transformers' AttentionInterface with RoPE
# from position_ids and nothing crossing tokens but attention: packing is exact for them
# (without a sliding window, :func:`packing_supported`).
PACKABLE_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
# Attention blocks: examples padded to their group's longest cost this many tokens per
# extra sdpa call (measured: benchmarks/README.md, "Packed micro-batches").
ATTN_GROUP_COST_TOKENS = 128.0
SETTINGS = ("auto", True, False)


def check_setting(value, field: str = "train.packing"):
    """``train.packing``: auto (or null) | true | false (the strings 'true'/'false' too);
    returns 'auto', True or False."""
    from clusterft.pipeline.errors import InputError

    if value is None:
        return "auto"
    if isinstance(value, str) and value.lower() in ("true", "false"):
        value = value.lower() == "true"
    if value not in SETTINGS or (not isinstance(value, bool) and value != "auto"):
        raise InputError(f"packing must be auto, true or false, got {value!r}", field=field)
    return value


def hf_model(model):
    """The transformers model inside a peft wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) and hasattr(model, "peft_config") else model


def packing_supported(model) -> tuple[bool, str]:
    """(whether packing is exact for ``model``, why not)."""
    m = hf_model(model)
    cfg = getattr(m, "config", None)
    model_type = getattr(cfg, "model_type", "")
    if model_type not in PACKABLE_TYPES:
        return False, f"model type '{model_type}' is not one of {', '.join(sorted(PACKABLE_TYPES))}"
    if getattr(cfg, "sliding_window", None) is not None and getattr(cfg, "use_sliding_window", True):
        return False, "the model uses sliding-window attention"
    if not getattr(m, "_supports_attention_backend", False):
        return False, f"{type(m).__name__} does not use transformers' attention interface"
    return True, ""


def resolve_packing(setting, model, field: str = "train.packing") -> bool:
    """auto: packed where :func:`packing_supported`; true: packed (InputError where it is
    not exact); false: padded."""
    from clusterft.pipeline.errors import InputError

    setting = check_setting(setting, field)
    if setting is False:
        return False
    ok, why = packing_supported(model)
    if setting is True and not ok:
        raise InputError(f"packing: true, but packed micro-batches are not exact here: {why} "
                         "(set packing: auto or false)", field=field)
    return ok


def attn_implementation(device) -> str:
    """The attention that packed rows use on ``device``: flash-attn's varlen kernels on a
    CUDA GPU where flash-attn is installed, else :data:`PACKED_ATTN`."""
    if torch.device(device).type == "cuda":
        from transformers.utils import is_flash_attn_2_available

        if is_flash_attn_2_available():
            return FLASH_ATTN
    return PACKED_ATTN


def enable(model, device) -> tuple[str, str | None]:
    """Switch ``model``'s attention to the packed one for ``device``; returns (the new
    implementation, the one before, for :func:`restore`)."""
    register()
    m = hf_model(model)
    before = getattr(m.config, "_attn_implementation", None)
    impl = attn_implementation(device)
    if before != impl:
        m.set_attn_implementation(impl)
    return impl, before


def restore(model, before: str | None) -> None:
    """Put back the attention implementation :func:`enable` replaced."""
    m = hf_model(model)
    if before and getattr(m.config, "_attn_implementation", None) != before:
        m.set_attn_implementation(before)


# --------------------------------------------------------------------------- the row

def pack_examples(examples: Sequence[dict]) -> dict[str, torch.Tensor]:
    """One row of ``examples``, concatenated: input_ids, labels (each example's first token
    -100), attention_mask (ones), position_ids (0.. per example), all [1, T] int64, and
    cu_seq_lens [n + 1] int32 (the examples' starts, then T)."""
    lengths = [len(e["input_ids"]) for e in examples]
    ids = torch.as_tensor(np.concatenate([np.asarray(e["input_ids"], dtype=np.int64)
                                          for e in examples]))
    labels = np.concatenate([np.asarray(e["labels"], dtype=np.int64) for e in examples])
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    labels[starts[:-1]] = IGNORE_INDEX  # no example is predicted from the one before it
    pos = np.arange(starts[-1], dtype=np.int64) - np.repeat(starts[:-1], lengths)
    return {"input_ids": ids[None], "labels": torch.as_tensor(labels)[None],
            "attention_mask": torch.ones_like(ids)[None], "position_ids": torch.as_tensor(pos)[None],
            "cu_seq_lens": torch.as_tensor(starts, dtype=torch.int32)}


def pack_collate(examples: Sequence[dict]) -> dict[str, torch.Tensor]:
    """:func:`pack_examples` (a collate function, as :class:`clusterft.modeling.tokenize.Collator`)."""
    return pack_examples(examples)


@dataclass
class AttnPlan:
    """Where each example of a packed row sits in the padded attention blocks: per block
    ``index`` [n, L] (row positions, padding repeats the example's last token) and, for the
    row, ``inverse`` [T] (each token's place in the blocks' concatenated outputs)."""

    blocks: list[torch.Tensor]
    inverse: torch.Tensor


def attn_plan(cu_seq_lens: torch.Tensor, group_cost_tokens: float = ATTN_GROUP_COST_TOKENS,
              device=None) -> AttnPlan:
    """The length-grouped attention blocks of a packed row with these boundaries.
    ``group_cost_tokens`` < 0: one block of all examples."""
    from clusterft.modeling.microbatch import plan_micro_batches

    cu = np.asarray(cu_seq_lens.detach().cpu().tolist(), dtype=np.int64)
    starts, lengths = cu[:-1], np.diff(cu)
    groups = plan_micro_batches(lengths.tolist(), group_cost_tokens)
    inverse = np.empty(int(cu[-1]), dtype=np.int64)
    blocks, off = [], 0
    for g in groups:
        L = int(lengths[g].max())
        ar = np.arange(L)
        blocks.append(np.stack([starts[i] + np.minimum(ar, lengths[i] - 1) for i in g]))
        for r, i in enumerate(g):
            inverse[starts[i]:starts[i] + lengths[i]] = off + r * L + np.arange(lengths[i])
        off += len(g) * L
    device = cu_seq_lens.device if device is None else device
    return AttnPlan([torch.as_tensor(b, device=device) for b in blocks],
                    torch.as_tensor(inverse, device=device))


def varlen_sdpa_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                          scaling: float | None = None, packed_plan: AttnPlan | None = None,
                          **kwargs):
    """transformers attention function: with ``packed_plan`` (a packed row, batch 1),
    causal attention inside each example, by sdpa over length-grouped padded blocks; without
    one, transformers' ``sdpa`` as it is."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    if packed_plan is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"a packed row has batch size 1, got {query.shape[0]}")
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    q, k, v = query[0], key[0], value[0]  # [H, T, d]
    p = dropout if module.training else 0.0
    outs = []
    for index in packed_plan.blocks:
        n, L = index.shape
        o = F.scaled_dot_product_attention(q[:, index].transpose(0, 1), k[:, index].transpose(0, 1),
                                           v[:, index].transpose(0, 1), dropout_p=p,
                                           is_causal=True, scale=scaling)  # [n, H, L, d]
        outs.append(o.transpose(1, 2).reshape(n * L, o.shape[1], o.shape[-1]))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.index_select(0, packed_plan.inverse).unsqueeze(0), None  # [1, T, H, d]


def forward_kwargs(impl: str, batch: dict[str, torch.Tensor]) -> dict:
    """The decoder's keyword arguments for a packed ``batch`` under attention ``impl``.

    :data:`PACKED_ATTN`: an all-ones attention mask (so transformers builds no [T, T] mask
    and runs no packed-sequence detection) and the plan; flash-attn: no mask, and the
    ``cu_seq_lens`` its varlen kernels take."""
    cu = batch["cu_seq_lens"]
    kw = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    if impl == PACKED_ATTN:
        kw["attention_mask"] = batch["attention_mask"]
        kw["packed_plan"] = attn_plan(cu)
    else:
        longest = int((cu[1:] - cu[:-1]).max())
        kw.update(attention_mask=None, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                  max_length_q=longest, max_length_k=longest)
    return kw


_REGISTERED = False


def register() -> None:
    """Register :data:`PACKED_ATTN` with transformers (attention, and sdpa's mask for calls
    without a plan)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PACKED_ATTN, varlen_sdpa_attention)
    AttentionMaskInterface.register(PACKED_ATTN, sdpa_mask)
    _REGISTERED = True
