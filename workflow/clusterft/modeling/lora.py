"""LoRA adapters (peft) on a causal LM: one config shape for scoring and fine-tuning."""

from __future__ import annotations

from clusterft.pipeline.errors import InputError

DEFAULTS: dict = {
    # Adapter rank.
    "r": 8,
    # Scaling numerator (the adapter output is scaled by alpha / r).
    "alpha": 16,
    # Dropout on the adapter input (scoring computes gradients in eval mode, without it).
    "dropout": 0.05,
    # Linear layers that get adapters (Llama attention projections, as in LESS).
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
}


def check(cfg: dict, field: str) -> None:
    """Bad values of a merged ``lora`` section raise InputError naming ``field.key``."""
    if int(cfg["r"]) < 1:
        raise InputError(f"must be >= 1, got {cfg['r']}", field=f"{field}.r")
    if not cfg["target_modules"]:
        raise InputError("needs at least one module name", field=f"{field}.target_modules")


def add_lora(model, cfg: dict, field: str, seed: int | None = None):
    """Wrap ``model`` with fresh LoRA adapters from a merged ``lora`` section.

    Only the adapters require grad once wrapped (peft freezes the rest). ``seed`` draws
    their init from a forked RNG (the caller's stream is untouched); None draws it from the
    global stream, as the caller seeded it.
    """
    import torch
    from peft import LoraConfig, get_peft_model

    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    missing = [t for t in cfg["target_modules"] if t not in names]
    if missing:
        raise InputError(f"model has no module named {missing}; e.g. {sorted(names)[:12]}",
                         field=f"{field}.target_modules")
    lcfg = LoraConfig(r=int(cfg["r"]), lora_alpha=float(cfg["alpha"]),
                      lora_dropout=float(cfg["dropout"]),
                      target_modules=list(cfg["target_modules"]), bias="none",
                      task_type="CAUSAL_LM")
    if seed is None:
        return get_peft_model(model, lcfg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(model, lcfg)
