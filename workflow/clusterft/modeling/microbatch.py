"""Less padding, same gradient: length-grouped micro-batches and a label-only LM head.

A rank's step batch is padded to its longest example, so on a CPU (and on a GPU with a
memory-bound model) the padding costs as much as real tokens: for the embedded pools the
padded batches are 1.2x (skills) to 1.8x (pycode) the real tokens. Two exact rewrites of
one training step remove most of that work without changing what is learned:

* :func:`plan_micro_batches` sorts the step's examples by length and cuts them into
  contiguous groups, each padded only to its own longest; the cut points minimise padded
  tokens plus a fixed cost per extra group (``group_cost_tokens``), by dynamic programming.
  The groups' summed losses, divided by the step's label-token count, give back the
  gradient of the single padded batch (DDP syncs only on the last group).
* :class:`CausalLMLoss` runs the model's decoder and applies the LM head only at positions
  whose next token carries a label (the response), instead of at every position of every
  row, and returns the summed next-token loss. For a vocabulary of 2048 and hidden size
  128 the head is ~45% of the per-token work of the embedded small model.

* With ``packing`` (:mod:`clusterft.modeling.packing`), the step's examples are one packed
  row instead: no padding at all outside attention, the same summed loss.

``benchmarks/bench_train_step.py`` measures them against the plain padded step side by side.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from clusterft.modeling.tokenize import IGNORE_INDEX, round_up

# Architectures whose logits are exactly lm_head(last hidden state), with nothing after
# the head (no soft-capping, no logit scale): the label-only head is exact for them.
SPARSE_LOGIT_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def sparse_logits_apply(model: torch.nn.Module, sparse_logits: bool) -> bool:
    """Whether the label-only head is asked for and exact for ``model``'s architecture."""
    model_type = getattr(getattr(model, "config", None), "model_type", "")
    return bool(sparse_logits) and model_type in SPARSE_LOGIT_TYPES


def label_logits(model: torch.nn.Module, input_ids: torch.Tensor,
                 attention_mask: torch.Tensor | None, labels: torch.Tensor, **decoder_kw):
    """(logits [M, V], targets [M], keep [B, T-1]) at the M positions that predict a label:
    the decoder's hidden states there go through the LM head, the others do not.
    ``decoder_kw``: more decoder arguments (a packed row's position ids and plan)."""
    target = labels[:, 1:]
    keep = target != IGNORE_INDEX
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                 use_cache=False, **decoder_kw).last_hidden_state
    return model.get_output_embeddings()(hidden[:, :-1][keep]), target[keep], keep


def plan_micro_batches(lengths: Sequence[int], group_cost_tokens: float,
                       pad_to_multiple_of: int = 1) -> list[list[int]]:
    """Split a batch into length-sorted groups minimising padded tokens + a cost per group.

    ``lengths[i]`` is example i's token count. Returns lists of positions into ``lengths``
    (every position exactly once; shortest examples first). A group of examples padded to
    its longest (rounded up to ``pad_to_multiple_of``) costs ``size * padded length +
    group_cost_tokens``; the split is optimal for that cost (O(n^2) over contiguous runs of
    the sorted lengths, which contain an optimum). ``group_cost_tokens`` < 0 disables
    splitting (one group, original order).
    """
    n = len(lengths)
    if n == 0:
        return []
    if group_cost_tokens < 0:
        return [list(range(n))]
    order = np.argsort(np.asarray(lengths, dtype=np.int64), kind="stable")
    s = np.asarray([round_up(lengths[i], pad_to_multiple_of) for i in order], dtype=np.float64)
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    cut = np.zeros(n + 1, dtype=np.int64)
    for j in range(1, n + 1):
        # group = sorted positions i..j-1, padded to s[j-1]
        cand = best[:j] + (j - np.arange(j)) * s[j - 1] + group_cost_tokens
        i = int(np.argmin(cand))
        best[j], cut[j] = cand[i], i
    groups: list[list[int]] = []
    j = n
    while j > 0:
        groups.append(order[cut[j]:j].tolist())
        j = int(cut[j])
    return groups[::-1]


def label_count(example: dict) -> int:
    """Tokens of an encoded example that carry a next-token loss (labels[1:] != -100)."""
    return sum(1 for t in example["labels"][1:] if t != IGNORE_INDEX)


def padded_size(lengths: Sequence[int], groups: list[list[int]], pad_to_multiple_of: int = 1) -> int:
    """Tokens processed, padding included, when ``groups`` are padded separately."""
    return int(sum(len(g) * round_up(max(lengths[i] for i in g), pad_to_multiple_of)
                   for g in groups if g))


class CausalLMLoss(torch.nn.Module):
    """Summed next-token cross-entropy over label tokens (labels == -100 are skipped).

    Wrap this module (not the bare model) in DDP so gradient sync still hooks the forward.
    With ``sparse_logits`` and an architecture in :data:`SPARSE_LOGIT_TYPES`, the LM head
    runs only at positions that predict a label; otherwise the model's full logits are used.
    Both give the same value; ``self.sparse`` says which path runs.

    ``packing``: batches may be packed rows (:func:`clusterft.modeling.packing.pack_examples`,
    with ``position_ids`` and ``cu_seq_lens``); the model's attention is switched to the
    packed one for its device (``self.attn``; :meth:`release` puts the old one back).
    Padded batches still run as before. Only ask for it where
    :func:`clusterft.modeling.packing.packing_supported`.
    """

    def __init__(self, model: torch.nn.Module, sparse_logits: bool = True,
                 packing: bool = False) -> None:
        super().__init__()
        from clusterft.modeling import packing as pk

        self.model = model
        self.sparse = sparse_logits_apply(model, sparse_logits)
        self.packing = bool(packing)
        self.attn, self._attn_before = None, None
        if self.packing:
            device = next(model.parameters()).device
            self.attn, self._attn_before = pk.enable(model, device)

    def release(self) -> None:
        """Put back the model's attention implementation from before packing."""
        from clusterft.modeling import packing as pk

        if self.packing and self._attn_before is not None:
            pk.restore(self.model, self._attn_before)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                labels: torch.Tensor, position_ids: torch.Tensor | None = None,
                cu_seq_lens: torch.Tensor | None = None) -> torch.Tensor:
        kw: dict = {}
        if cu_seq_lens is not None:  # a packed row
            from clusterft.modeling.packing import forward_kwargs

            if not self.packing:
                raise ValueError("a packed batch needs CausalLMLoss(..., packing=True)")
            kw = forward_kwargs(self.attn, {"input_ids": input_ids, "attention_mask": attention_mask,
                                            "position_ids": position_ids, "cu_seq_lens": cu_seq_lens})
            input_ids, attention_mask = kw.pop("input_ids"), kw.pop("attention_mask")
        if self.sparse:
            logits, target, _ = label_logits(self.model, input_ids, attention_mask, labels, **kw)
        else:
            keep = labels[:, 1:] != IGNORE_INDEX
            target = labels[:, 1:][keep]
            logits = self.model(input_ids=input_ids, attention_mask=attention_mask,
                                **kw).logits[:, :-1][keep]
        return F.cross_entropy(logits.float(), target, reduction="sum")


def backward_step(loss_fn: torch.nn.Module, examples: Sequence[dict], collate: Callable,
                  group_cost_tokens: float, device: torch.device | str = "cpu", bf16: bool = False,
                  no_sync: Callable[[], contextlib.AbstractContextManager] | None = None,
                  denom: float | None = None, pad_to_multiple_of: int = 1,
                  packed: bool = False) -> tuple[float, int, int]:
    """Forward + backward of one step's ``examples`` as length-grouped micro-batches, or
    with ``packed`` as one packed row (``loss_fn`` a ``CausalLMLoss(..., packing=True)``;
    ``collate``, ``group_cost_tokens`` and ``pad_to_multiple_of`` are then unused).

    Accumulates into the parameters' ``.grad`` the gradient of the summed next-token loss
    divided by ``denom``; by default the step's label-token count, i.e. the mean over all of
    its label tokens (what one padded batch would give). Under DDP, which averages over
    ranks, pass the global label count / world size to get the mean over the global batch.
    ``no_sync`` (DDP's) wraps every group but the last, so gradients are reduced once per
    step. Groups are padded to a multiple of ``pad_to_multiple_of`` (``collate`` must pad
    the same way). Returns (loss, real tokens, padded tokens processed).
    """
    device = torch.device(device)
    if packed:
        from clusterft.modeling.packing import pack_collate

        groups, collate = [list(range(len(examples)))] if examples else [], pack_collate
    else:
        groups = plan_micro_batches([e["length"] for e in examples], group_cost_tokens,
                                    pad_to_multiple_of)
    if denom is None:
        denom = sum(label_count(e) for e in examples)
    denom = max(1.0, float(denom))
    loss_val, real, padded = 0.0, 0, 0
    for g, group in enumerate(groups):
        batch = {k: v.to(device) for k, v in collate([examples[i] for i in group]).items()}
        last = g == len(groups) - 1
        with contextlib.nullcontext() if last or no_sync is None else no_sync():
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                loss = loss_fn(**batch) / denom
            loss.backward()
        loss_val += float(loss.detach())
        real += int(batch["attention_mask"].sum())
        padded += int(batch["input_ids"].numel())
    return loss_val, real, padded
