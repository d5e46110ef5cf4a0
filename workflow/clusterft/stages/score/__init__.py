"""Stage ``score``: per-example gradient features of a briefly warmed-up LoRA model (the
LESS recipe), the features that gradient-based selection (LESS, clustering on gradients)
and S2L's loss trajectories start from.

Why gradients: two examples whose loss gradients point the same way teach the model the
same thing; LESS's influence of a training example on a target is the cosine of their
(projected, Adam-preconditioned) gradients, summed over warm-up checkpoints with their
learning rates. The stage computes, per pool example:

1. a LoRA **warm-up** (``warmup``): without it every ``lora_B`` is zero and half the
   gradients are too; its checkpoints and the adapters at the S2L loss steps are kept;
2. the **per-example gradients** of each example's own loss (mean over its response
   tokens) w.r.t. the LoRA parameters, one batched forward/backward per batch
   (``gradients``), optionally as LESS's Adam direction;
3. their seeded random **projection** to ``dim`` (``projection``: dense, or LoGra's
   Kronecker form that never forms the per-example gradient), L2-normalised per
   checkpoint and concatenated with LESS's checkpoint weights (``merge``);
4. the **scalar score** (LESS's influence with the pool itself as the target set: the mean
   cosine with every other example), the gradient norm, the **loss trajectories** (S2L)
   and, for LESS, the validation targets' features from the same warm-up and projection.

One path for one job and for N (``entry``): a warm-up, a gradient pass over shards of
consecutive batches of the length-sorted pool (``gradient_pass``), a merge. With
``score.shards: 1`` one process runs the three, the whole pool being the one shard; more
shards split the pass over jobs (one GPU each), and the merged files are the same bytes,
because every shard runs exactly the batches one job would. Every job resumes after a kill
(``resume``).

Modules: ``settings`` (merge_cfg, the score.shards rule), ``model`` (the one model, LoRA
and projector setup), ``warmup``, ``gradients``, ``projection``, ``gradient_pass``,
``merge``, ``entry`` (run_score, run_score_warmup, run_score_shard, run_score_merge,
compute_features). DEFAULTS stays here, with a comment per key: config/README.md's key
reference is generated from this file (``clusterft.tools.configdoc``).
"""

from __future__ import annotations

import copy

from clusterft.modeling.lora import DEFAULTS as LORA_DEFAULTS

DEFAULTS: dict = {
    # Dimension of the random projection of the flattened LoRA gradient (LESS uses 8192 for
    # 7B models; a few hundred is plenty for the tiny models here).
    "dim": 128,
    # Examples per batched forward/backward (warm-up and gradients).
    "batch_size": 16,
    # Examples are tokenised like training and truncated to this many tokens (response
    # cut at the right first; see clusterft.modeling.tokenize). Every example keeps >= 1 loss token.
    # auto: measured from the run's pool by the job (clusterft.modeling.lengths: the
    # max_length_quantile quantile of its examples' token lengths, rounded up to a multiple
    # of 64, at most max_length_cap and the model's context), recorded in the provenance.
    "max_length": 256,
    # max_length auto: the share of the pool's examples that fit uncut.
    "max_length_quantile": 0.99,
    # max_length auto: never more than this many tokens (nor the model's context).
    "max_length_cap": 4096,
    # LoRA adapters whose gradients are the features (keys in clusterft.modeling.lora; their
    # dropout acts during the warm-up only: gradients are computed in eval mode). Unlike
    # LESS (attention only), on the attention AND MLP projections of a Llama: the gradient
    # clusters recovered the true skills better (docs/method_choices.md).
    "lora": {**copy.deepcopy(LORA_DEFAULTS),
             # Linear layers that get adapters: a Llama's attention and MLP projections
             # (LESS: attention only; docs/method_choices.md).
             "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj",
                                "gate_proj", "up_proj", "down_proj"]},
    # Fraction of the pool (seeded random sample) the warm-up trains on (LESS: 5%).
    "warmup_fraction": 0.05,
    # Warm-up optimiser steps; null means use warmup_epochs instead. 0 disables warm-up.
    "warmup_steps": None,
    # Passes over the warm-up subset when warmup_steps is null (LESS: 4 epochs).
    "warmup_epochs": 4,
    # Peak AdamW learning rate of the warm-up (linear warm-up over 3% of steps, then
    # linear decay to 0, no weight decay, as in LESS; higher than LESS's 2e-5 because the
    # models here are tiny; 3e-3 recovered the true skills better than 1e-3 and 3e-4:
    # docs/method_choices.md).
    "warmup_lr": 3.0e-3,
    # Warm-up checkpoints whose gradients make up the features (LESS: one per warm-up
    # epoch). The warm-up's steps are split into this many equal consecutive segments; the
    # LoRA weights (and AdamW moments) at the end of each are kept, the gradient pass runs
    # at each (same projection, same batches), and each checkpoint's rows f_k are
    # L2-normalised and concatenated as sqrt(w_k) * f_k, w_k = the segment's mean learning
    # rate / the sum over segments. Rows stay unit-norm and the cosine of two rows is LESS's
    # lr-weighted sum of per-checkpoint cosines, so the features are warmup_checkpoints *
    # dim wide. 1 (default): the end of the warm-up only. Needs >= as many warm-up steps.
    "warmup_checkpoints": 1,
    # Points of each example's loss trajectory (for S2L): its mean response-token loss,
    # measured (no-grad, eval mode: the warm-up is unchanged) over the whole pool at this many
    # evenly spaced warm-up steps from 0 (the base model) to the last; run_score writes them
    # to out_trajectories [N, loss_points]. Costs loss_points forward passes over the pool.
    # With no warm-up steps every point is the base model's loss (a warning says so).
    "loss_points": 5,
    # Run the LM head only at the positions that predict a response token (the loss's), in
    # the warm-up, the loss passes and the hook method's gradient pass, for the
    # architectures clusterft.modeling.microbatch.SPARSE_LOGIT_TYPES lists (others: full logits).
    # Same losses and gradients up to float rounding, less head work: the head is a large
    # share of a small model's forward (benchmarks/README.md).
    "sparse_logits": True,
    # Per-example gradient method: hook (captured layer inputs/output-grads + einsum,
    # fastest) or func (torch.func vmap over grad of functional_call).
    "method": "hook",
    # How each example's loss, whose gradient is the feature, is normalised over its
    # response tokens: mean (LESS; the per-example loss of the warm-up's loss) or sum (the
    # mean times the example's response-token count). The two gradients differ by that count
    # only, so with gradient_type sgd the features (rows L2-normalised per checkpoint) and
    # the clusters are the same; grad_norm, and the Adam direction, change
    # (docs/method_choices.md).
    "loss_normalization": "mean",
    # Gradient that is projected: sgd (the raw loss gradient) or adam (LESS's
    # Adam-preconditioned direction from the warm-up optimiser's moments).
    "gradient_type": "sgd",
    # Random projection: rademacher (+-1/sqrt(dim)) or gaussian (N(0, 1/dim)), dense
    # [D, dim] matrices; or kronecker (LoGra): per LoRA matrix two small seeded +-1 factors
    # P_out, P_in and the block P_out^T dW P_in formed from the projected layer inputs and
    # output gradients, so time and memory do not grow with D * dim (dim entries in all, an
    # equal share per matrix: clusterft.stages.score.projection). Same inner products in expectation;
    # not with gradient_type adam (elementwise in dW); grad_norm is then the projected
    # row's norm, an estimate.
    "projection": "rademacher",
    # Attention kernel while scoring: eager, sdpa, or null (keep the model's, sdpa for HF
    # Llama). The two give the same features up to float rounding; which is faster depends
    # on the machine and the model (benchmarks/README.md).
    "attn_implementation": None,
    # Device: auto (cuda if available, else cpu), cpu, cuda, cuda:N.
    "device": "auto",
    # auto | bf16 | fp32, as train.precision: bf16 runs the forward passes (warm-up, loss
    # passes, gradient pass) under bfloat16 autocast, and on a CUDA GPU loads the frozen base
    # in bfloat16 straight onto it (half the memory: clusterft.modeling.precision.base_dtype);
    # the LoRA weights, the warm-up's AdamW state and the per-example gradients that are
    # projected stay float32. auto = bf16 on a CUDA GPU with bf16, fp32 on every CPU.
    "precision": "auto",
    # Torch intra-op threads; 0 uses run_score's `threads` argument (Snakemake's), else
    # torch's default. Default 1: the score rule books one core, so Snakemake runs as many
    # scoring jobs side by side as there are cores; whether a second thread speeds one job
    # up depends on the CPU and on what else runs (benchmarks/README.md). Raise it for
    # bigger models on more cores.
    "num_threads": 1,
    # Batches of the gradient pass between resumable checkpoints (0 disables): a killed
    # score job keeps its warm-up and the rows done so far in <features>.ckpt/ and resumes
    # from them to the same features (the folder is removed once the features are written).
    "checkpoint_every": 50,
    # Jobs the pool is scored in (the workflow; one GPU each): a score_warmup job trains the
    # warm-up once, score_shard jobs compute the gradient features, loss trajectories (and,
    # in shard 0, the targets) of consecutive runs of the gradient pass's length-sorted
    # batches, and score merges them into the same files, bit for bit, as one job would
    # write (run_score_warmup, run_score_shard, run_score_merge). 1: one score job. At most
    # the pool size.
    "shards": 1,
}

# Below DEFAULTS: settings reads it from here.
from clusterft.pipeline.rows import pool_scores  # noqa: E402
from clusterft.stages.score.settings import (  # noqa: E402
    ADAM_BETAS, ADAM_EPS, ATTN, DENSE_PROJECTIONS, GRADIENT_TYPES, METHODS,
    PROJECTION_CHUNK_ROWS, PROJECTIONS, RESUMABLE_ACROSS, check_shards, merge_cfg)
from clusterft.stages.score.gradients import (  # noqa: E402
    GRAD_FNS, adam_direction, batch_loss, example_losses, grads_func, grads_hook,
    grads_hook_kronecker, grads_loop, lora_parameters, per_example_grads, per_example_loss,
    project_batch, set_lora, use_sparse_logits)
from clusterft.stages.score.projection import (  # noqa: E402
    KroneckerProjector, Projector, make_projector)
from clusterft.stages.score.model import Scoring, num_threads, scoring_model  # noqa: E402
from clusterft.stages.score.resume import Checkpoints, score_fingerprint  # noqa: E402
from clusterft.stages.score.warmup import (  # noqa: E402
    WARMUP_FORMAT, checkpoint_ends, load_warmup, loss_steps, loss_trajectories, pool_losses,
    save_warmup, warm_up, warmup_lora, warmup_state)
from clusterft.stages.score.merge import (  # noqa: E402
    SHARD_FORMAT, TARGET_SHARD, checkpoint_weights, combine_checkpoints, l2_normalize,
    load_shard, pool_features, refuse_rows, target_features)
from clusterft.stages.score.gradient_pass import (  # noqa: E402
    gradient_pass, shard_bounds, target_pass)
from clusterft.stages.score.entry import (  # noqa: E402
    _encode_all, compute_features, compute_features_info, run_score, run_score_merge,
    run_score_shard, run_score_warmup)
