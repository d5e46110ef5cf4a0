"""The score section checked once: ``merge_cfg`` (every key and value of a run's score
section, before any work) and ``check_shards``, the one rule for ``score.shards``, which the
config check (``clusterft.plan.config.check_shards``, against each dataset's pool size) and
the score jobs (against the pool they read) both apply, so the two cannot disagree."""

from __future__ import annotations

from clusterft.modeling import lora
from clusterft.modeling.lengths import check_keys as check_lengths
from clusterft.modeling.lengths import is_auto
from clusterft.modeling.precision import PRECISIONS
from clusterft.pipeline.errors import InputError
from clusterft.pipeline.sections import merge_section
from clusterft.stages.score import DEFAULTS

# Keys that change neither the warm-up nor the features: a run may resume across them.
# (max_length_quantile and max_length_cap act through max_length, which a run fingerprints
# as resolved: clusterft.modeling.lengths.)
RESUMABLE_ACROSS = ("checkpoint_every", "num_threads", "shards", "max_length_quantile",
                    "max_length_cap")

METHODS = ("hook", "func")
LOSS_NORMALIZATIONS = ("mean", "sum")
GRADIENT_TYPES = ("sgd", "adam")
DENSE_PROJECTIONS = ("rademacher", "gaussian")
PROJECTIONS = (*DENSE_PROJECTIONS, "kronecker")
ATTN = (None, "eager", "sdpa")
PROJECTION_CHUNK_ROWS = 4096  # fixed: part of the definition of the projection matrix
ADAM_BETAS, ADAM_EPS = (0.9, 0.999), 1e-8


def check_shards(shards, n: int | None = None, pool: str = "the pool",
                 path: str | None = None) -> int:
    """``score.shards`` as an int: an integer >= 1 and, given the pool's size ``n``, at most
    ``n`` (each shard job gets at least one example). InputError naming the field."""
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise InputError(f"must be an integer >= 1, got {shards!r}", path=path,
                         field="score.shards")
    if n is not None and shards > n:
        raise InputError(f"score.shards = {shards} is larger than {pool} ({n} examples)",
                         path=path, field="score.shards")
    return shards


def merge_cfg(cfg: dict | None) -> dict:
    """Return ``cfg`` merged over DEFAULTS; unknown keys and bad values raise InputError."""
    out = merge_section(DEFAULTS, cfg, "score")
    for key, valid in (("method", METHODS), ("gradient_type", GRADIENT_TYPES),
                       ("projection", PROJECTIONS), ("attn_implementation", ATTN),
                       ("precision", PRECISIONS),
                       ("loss_normalization", LOSS_NORMALIZATIONS)):
        if out[key] not in valid:
            raise InputError(f"unknown value '{out[key]}'; valid: {', '.join(map(str, valid))}",
                             field=f"score.{key}")
    check_lengths(out, "score")
    for key in ("dim", "batch_size", "max_length"):
        if not is_auto(out[key]) and int(out[key]) < 1:
            raise InputError(f"must be >= 1, got {out[key]}", field=f"score.{key}")
    if out["projection"] == "kronecker" and out["gradient_type"] == "adam":
        raise InputError("projection 'kronecker' cannot give gradient_type 'adam': LESS's "
                         "Adam direction divides each weight's gradient elementwise by "
                         "sqrt(v), which has no Kronecker (P_out^T dW P_in) form, so it "
                         "needs the whole per-example gradient; use projection rademacher "
                         "or gaussian with adam", field="score.projection")
    _check_checkpoints(out)
    if not isinstance(out["sparse_logits"], bool):
        raise InputError(f"must be true or false, got {out['sparse_logits']!r}",
                         field="score.sparse_logits")
    check_shards(out["shards"])
    _check_warmup(out)
    lora.check(out["lora"], "score.lora")
    return out


def _check_checkpoints(out: dict) -> None:
    """warmup_checkpoints: >= 1, and no more than the warm-up's steps."""
    if int(out["warmup_checkpoints"]) < 1:
        raise InputError(f"must be >= 1, got {out['warmup_checkpoints']}",
                         field="score.warmup_checkpoints")
    if (int(out["warmup_checkpoints"]) > 1 and out["warmup_steps"] is not None
            and int(out["warmup_steps"]) < int(out["warmup_checkpoints"])):
        raise InputError(f"{out['warmup_checkpoints']} checkpoints need at least as many "
                         f"warm-up steps, got warmup_steps {out['warmup_steps']}",
                         field="score.warmup_checkpoints")


def _check_warmup(out: dict) -> None:
    """The warm-up's other keys: loss points, subset, steps or epochs."""
    if int(out["loss_points"]) < 2:
        raise InputError(f"must be >= 2, got {out['loss_points']}", field="score.loss_points")
    if not 0 < float(out["warmup_fraction"]) <= 1:
        raise InputError(f"must be in (0, 1], got {out['warmup_fraction']}",
                         field="score.warmup_fraction")
    if out["warmup_steps"] is not None and int(out["warmup_steps"]) < 0:
        raise InputError(f"must be >= 0 or null, got {out['warmup_steps']}",
                         field="score.warmup_steps")
    if out["warmup_steps"] is None and float(out["warmup_epochs"]) < 0:
        raise InputError(f"must be >= 0, got {out['warmup_epochs']}", field="score.warmup_epochs")
