"""Fine-tuning: real 2-rank torchrun runs, single-process loss/determinism, LoRA merge, resume."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from clusterft.pipeline.errors import InputError
from clusterft.pipeline.io import write_parquet
from clusterft.pipeline.sections import parse_section_arg
from clusterft.stages.train import run_train, train_config

BASE_CFG = {"batch_size": 4, "epochs": 1, "max_length": 64, "lr": 3e-3, "log_every": 1}


def make_selection(path: Path, pool: list[dict], n: int, k: int = 4) -> Path:
    """The first n pool ids, cluster = skill index (as a selection stage would write it)."""
    rows = [{"id": r["id"], "cluster": i % k, "score": float(i)} for i, r in enumerate(pool)][:n]
    write_parquet(path, pd.DataFrame(rows))
    return path


def weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


def reload(model_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True),
            AutoTokenizer.from_pretrained(model_dir, local_files_only=True))


def torchrun(nproc: int, model: Path, pool: Path, sel: Path, out: Path, met: Path, distribution: str,
             seed: int, cfg: dict, cwd: Path, threads: int | None = None) -> subprocess.CompletedProcess:
    """`python -m clusterft.stages.train` on `nproc` ranks under torchrun, offline."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    args = ["--model", str(model), "--pool", str(pool), "--selection", str(sel), "--out", str(out),
            "--metrics", str(met), "--distribution", distribution, "--seed", str(seed),
            "--config", json.dumps(cfg)]
    if threads is not None:
        args += ["--threads", str(threads)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "clusterft.stages.train", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.parametrize("distribution", ["random", "balanced"])
def test_two_rank_torchrun(tmp_path, tiny_model_dir, tiny_pool, tiny_pool_path, distribution):
    n, bs, epochs = 37, 4, 2
    sel = make_selection(tmp_path / "sel.parquet", tiny_pool, n)
    cfg = {**BASE_CFG, "batch_size": bs, "epochs": epochs}
    out, met = tmp_path / "model", tmp_path / "train_metrics.json"
    r = torchrun(2, tiny_model_dir, tiny_pool_path, sel, out, met, distribution, 1, cfg, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads(met.read_text())
    steps = math.ceil(n / (bs * 2)) * epochs
    assert m["world_size"] == 2 and m["distribution"] == distribution and m["backend"] == "gloo"
    assert m["steps"] == steps == len(m["per_rank_tokens_per_step"]) == len(m["padded_tokens_per_step"])
    assert m["examples"] == n and m["epochs"] == epochs
    assert all(len(row) == 2 for row in m["per_rank_tokens_per_step"])
    assert m["tokens"] == sum(map(sum, m["per_rank_tokens_per_step"]))
    # every example seen once per epoch: real tokens >= the selection's tokens x epochs
    # (sampler padding may repeat a few), each rank's padded >= real tokens
    from clusterft.modeling.hf import load_tokenizer
    from clusterft.modeling.tokenize import encode_records

    tok = load_tokenizer(tiny_model_dir)
    sel_ids = set(pd.read_parquet(sel)["id"])
    encs, _ = encode_records(tok, [r for r in tiny_pool if r["id"] in sel_ids], cfg["max_length"])
    lens = sorted(e["length"] for e in encs)
    need = sum(lens) * epochs
    pad_extra = (steps // epochs * bs * 2 - n) * epochs  # duplicated examples at most
    assert need <= m["tokens"] <= need + pad_extra * lens[-1]
    for real, padded in zip(m["per_rank_tokens_per_step"], m["padded_tokens_per_step"]):
        assert all(p >= t > 0 for t, p in zip(real, padded))
    assert m["wall_time_s"] > 0 and m["total_time_s"] >= m["wall_time_s"]
    assert np.isfinite(m["final_loss"]) and len(m["loss_curve"]) == steps
    model, tok2 = reload(out)
    assert tok2.pad_token_id == model.config.pad_token_id
    base = weights(tiny_model_dir)
    assert any(not torch.equal(base[k], v) for k, v in weights(out).items())


def test_global_batch_two_ranks_equal_one_rank(tmp_path, tiny_model_dir, tiny_pool, tiny_pool_path):
    """With global_batch_size, 2 ranks (4 each) train what 1 rank (8) trains: the same
    global batches (DistributedSampler), the gradient of their mean label-token loss
    (each rank divides by the global label count / world size), hence the same weights.
    Uneven label counts between the ranks' halves make per-rank means differ."""
    n = 32
    sel = make_selection(tmp_path / "sel.parquet", tiny_pool, n)
    cfg = {**BASE_CFG, "global_batch_size": 8, "batch_size": 99, "epochs": 2}
    two, met2 = tmp_path / "two", tmp_path / "two.json"
    r = torchrun(2, tiny_model_dir, tiny_pool_path, sel, two, met2, "random", 3, cfg, tmp_path,
                 threads=2)
    assert r.returncode == 0, r.stderr[-3000:]
    m2 = json.loads(met2.read_text())
    one, met1 = tmp_path / "one", tmp_path / "one.json"
    m1 = run_train(tiny_model_dir, tiny_pool_path, sel, one, met1, "random", 3, cfg)
    assert m2["batch_size"] == 4 and m1["batch_size"] == 8
    assert m1["global_batch_size"] == m2["global_batch_size"] == 8
    assert m1["steps"] == m2["steps"] == n // 8 * 2
    assert m2["threads_per_rank"] == 1
    per_rank = np.array(m2["per_rank_loss_tokens_per_step"])
    assert (per_rank[:, 0] != per_rank[:, 1]).any()  # the ranks' halves differ in labels
    assert np.allclose(m1["loss_curve"], m2["loss_curve"], rtol=1e-5, atol=1e-6)
    w1, w2 = weights(one), weights(two)
    assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) < 1e-5


def test_one_rank_under_torchrun_trains_without_a_process_group(tmp_path, tiny_model_dir, tiny_pool,
                                                                tiny_pool_path):
    """torchrun with one rank runs the plain single-process path (no process group, no DDP
    wrapper, whose all-reduces over one rank average nothing): the same weights, bit for
    bit, as run_train in this process with the same thread count."""
    sel = make_selection(tmp_path / "sel.parquet", tiny_pool, 24)
    cfg = {**BASE_CFG, "epochs": 2}
    run, met = tmp_path / "run", tmp_path / "run.json"
    r = torchrun(1, tiny_model_dir, tiny_pool_path, sel, run, met, "balanced", 2, cfg, tmp_path,
                 threads=1)
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads(met.read_text())
    assert m["world_size"] == 1 and m["backend"] is None and m["threads_per_rank"] == 1
    here, met_here = tmp_path / "here", tmp_path / "here.json"
    threads = torch.get_num_threads()
    try:
        m_here = run_train(tiny_model_dir, tiny_pool_path, sel, here, met_here, "balanced", 2, cfg,
                           job_threads=1)
    finally:
        torch.set_num_threads(threads)
    assert m_here["backend"] is None and m_here["loss_curve"] == m["loss_curve"]
    w, w_here = weights(run), weights(here)
    assert set(w) == set(w_here) and all(torch.equal(w[k], w_here[k]) for k in w)


def test_backend_follows_the_device():
    from clusterft.modeling.distributed import resolve_backend

    assert resolve_backend("auto", cuda=True) == "nccl"
    assert resolve_backend("auto", cuda=False) == "gloo"
    assert resolve_backend("gloo", cuda=True) == "gloo"
    assert resolve_backend("nccl", cuda=True) == "nccl"
    with pytest.raises(InputError, match="train.backend"):
        resolve_backend("nccl", cuda=False)
    with pytest.raises(InputError, match="train.backend"):
        train_config({"backend": "glo"})
    with pytest.raises(InputError, match="train.device"):
        train_config({"device": "gpu"})


def test_global_batch_size_must_divide(tmp_path, tiny_model_dir, tiny_pool, tiny_pool_path):
    from clusterft.stages.train import rank_batch_size

    assert rank_batch_size({"batch_size": 5, "global_batch_size": None}, 4) == 5
    assert rank_batch_size({"batch_size": 5, "global_batch_size": 12}, 4) == 3
    with pytest.raises(InputError, match="train.global_batch_size"):
        rank_batch_size({"batch_size": 5, "global_batch_size": 10}, 4)
    with pytest.raises(InputError, match="train.global_batch_size"):
        train_config({"global_batch_size": 0})


def run_single(tmp_path: Path, model_dir, pool_path, pool, name: str, cfg: dict, seed: int = 0,
               n: int = 32) -> tuple[dict, Path]:
    sel = make_selection(tmp_path / f"{name}.parquet", pool, n)
    out, met = tmp_path / name, tmp_path / f"{name}.json"
    m = run_train(model_dir, pool_path, sel, out, met, "random", seed, cfg)
    assert json.loads(met.read_text())["steps"] == m["steps"]
    return m, out


def test_single_process_loss_decreases(tmp_path, tiny_model_dir, tiny_pool, tiny_pool_path):
    cfg = {**BASE_CFG, "epochs": 6, "lr": 5e-3}
    m, out = run_single(tmp_path, tiny_model_dir, tiny_pool_path, tiny_pool, "a", cfg)
    assert m["world_size"] == 1 and m["steps"] == math.ceil(32 / 4) * 6
    assert m["epoch_losses"][-1] < 0.8 * m["epoch_losses"][0], m["epoch_losses"]
    assert all(len(r) == 1 for r in m["per_rank_tokens_per_step"])


def test_same_seed_same_weights(tmp_path, tiny_model_dir, tiny_pool, tiny_pool_path):
    cfg = {**BASE_CFG, "epochs": 1}
    _, a = run_single(tmp_path, tiny_model_dir, tiny_pool_path, tiny_pool, "a", cfg, seed=5, n=16)
    _, b = run_single(tmp_path, tiny_model_dir, tiny_pool_path, tiny_pool, "b", cfg, seed=5, n=16)
    _, c = run_single(tmp_path, tiny_model_dir, tiny_pool_path, tiny_pool, "c", cfg, seed=6, n=16)
    wa, wb, wc = weights(a), weights(b), weights(c)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert any(not torch.equal(wa[k], wc[k]) for k in wa)


LORA_CFG = {**BASE_CFG, "finetune": "lora", "lr": 1e-2,
            "lora": {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}}


def test_lora_saves_the_adapter_alone(tmp_path, tiny_model_dir, tiny_pool, tiny_pool_path):
    """A LoRA run keeps megabytes, not a copy of the base: the peft adapter naming its base,
    which reloads to the same weights a merged save would hold."""
    from peft import PeftModel

    from clusterft.modeling.hf import adapter_base

    _, out = run_single(tmp_path, tiny_model_dir, tiny_pool_path, tiny_pool, "lora", LORA_CFG, n=16)
    files = {p.name for p in out.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files
    assert "model.safetensors" not in files and "config.json" not in files
    assert adapter_base(out) == str(tiny_model_dir)
    _, merged = run_single(tmp_path, tiny_model_dir, tiny_pool_path, tiny_pool, "merged",
                           {**LORA_CFG, "merge_lora": True}, n=16)
    base, _ = reload(tiny_model_dir)
    again = PeftModel.from_pretrained(base, str(out)).merge_and_unload().state_dict()
    want = weights(merged)  # tied lm_head is not saved
    assert set(want) <= set(again) and set(again) - set(want) <= {"lm_head.weight"}
    assert all(torch.allclose(again[k], want[k], atol=1e-6) for k in want)


def test_lora_merged_saves_a_plain_model(tmp_path, tiny_model_dir, tiny_pool, tiny_pool_path):
    cfg = {**LORA_CFG, "merge_lora": True}
    m, out = run_single(tmp_path, tiny_model_dir, tiny_pool_path, tiny_pool, "lora", cfg, n=16)
    assert m["finetune"] == "lora"
    files = {p.name for p in out.iterdir()}
    assert "adapter_config.json" not in files and "model.safetensors" in files
    base, tuned = weights(tiny_model_dir), weights(out)
    assert set(base) == set(tuned)  # same plain parameter names, no lora_A/lora_B
    changed = {k for k in base if not torch.equal(base[k], tuned[k])}
    assert changed and all("q_proj" in k or "v_proj" in k for k in changed)
    model, _ = reload(out)
    assert type(model).__name__ == "LlamaForCausalLM"


def test_a_run_that_is_only_timed_keeps_no_model(tmp_path, tiny_model_dir, tiny_pool,
                                                tiny_pool_path):
    """keep_model: false (the plan's setting for time-only runs): the model folder holds
    NOT_KEPT.json and no weights, the metrics are as a kept run's, and nothing loads the
    folder as a model; the same run kept saves its adapter (LoRA) or model (full)."""
    from clusterft.modeling.hf import NOT_KEPT, WEIGHT_PATTERNS, resolve_model
    from clusterft.pipeline.provenance import sidecar_path

    for name, cfg, kept_file in (("lora", LORA_CFG, "adapter_model.safetensors"),
                                 ("full", BASE_CFG, "model.safetensors")):
        m_kept, kept = run_single(tmp_path, tiny_model_dir, tiny_pool_path, tiny_pool,
                                  f"{name}-kept", cfg, n=8)
        m_timed, timed = run_single(tmp_path, tiny_model_dir, tiny_pool_path, tiny_pool,
                                    f"{name}-timed", {**cfg, "keep_model": False}, n=8)
        assert (kept / kept_file).is_file()
        assert {f.name for f in timed.iterdir()} == {NOT_KEPT, sidecar_path(timed).name}
        assert not any(any(timed.glob(pat)) for pat in WEIGHT_PATTERNS)
        marker = json.loads((timed / NOT_KEPT).read_text())
        assert marker["kept"] is False and "only timed" in marker["why"]
        assert marker["run"]["out"] == str(timed) and marker["run"]["finetune"] == name
        # the bytes the weights would have taken: the saved safetensors' tensors
        from safetensors.torch import load_file

        tensors = load_file(str(kept / kept_file))
        assert marker["would_have_taken_bytes"] == sum(t.numel() * t.element_size()
                                                       for t in tensors.values())
        assert m_timed["final_loss"] == m_kept["final_loss"]  # trained alike
        with pytest.raises(InputError, match="only timed"):
            resolve_model(str(timed))
    with pytest.raises(InputError, match="true or false"):
        train_config({"keep_model": "no"})


def test_checkpoint_resume_matches_uninterrupted(tmp_path, tiny_model_dir, tiny_pool, tiny_pool_path):
    cfg = {**BASE_CFG, "epochs": 2, "checkpoint_every": 3}
    n = 20  # 5 steps per epoch: the checkpoint at step 3 is mid-epoch
    _, full = run_single(tmp_path, tiny_model_dir, tiny_pool_path, tiny_pool, "full", cfg, seed=2, n=n)
    assert not Path(str(full) + ".ckpt").exists()  # removed when training completes
    part, out = run_single(tmp_path, tiny_model_dir, tiny_pool_path, tiny_pool, "res",
                           {**cfg, "max_steps": 7}, seed=2, n=n)
    assert part["stopped_early"] and part["steps"] == 7
    assert (Path(str(out) + ".ckpt") / "state.pt").exists()
    done, out2 = run_single(tmp_path, tiny_model_dir, tiny_pool_path, tiny_pool, "res", cfg, seed=2, n=n)
    assert done["resumed_from_step"] == 7 and done["steps"] == 10 and not done["stopped_early"]
    assert len(done["per_rank_tokens_per_step"]) == 10
    wf, wr = weights(full), weights(out2)
    assert all(torch.allclose(wf[k], wr[k], atol=1e-6) for k in wf)


def test_bad_inputs(tmp_path, tiny_model_dir, tiny_pool, tiny_pool_path):
    sel = make_selection(tmp_path / "s.parquet", tiny_pool, 8)
    with pytest.raises(InputError, match="train.epoch"):
        train_config({"epoch": 3})
    with pytest.raises(InputError, match="finetune"):
        train_config({"finetune": "qlora"})
    bad = tmp_path / "bad.parquet"
    write_parquet(bad, pd.DataFrame({"id": ["nope"], "cluster": [0], "score": [0.0]}))
    with pytest.raises(InputError, match="nope"):
        run_train(tiny_model_dir, tiny_pool_path, bad, tmp_path / "o", tmp_path / "m.json", "random", 0, BASE_CFG)
    with pytest.raises(InputError, match="model"):
        run_train(tmp_path / "missing", tiny_pool_path, sel, tmp_path / "o", tmp_path / "m.json", "random", 0)
    assert parse_section_arg('{"epochs": 2}', "train") == {"epochs": 2}
    y = tmp_path / "c.yaml"
    y.write_text("train:\n  epochs: 4\nother: 1\n")
    assert parse_section_arg(str(y), "train") == {"epochs": 4}


def test_max_length_auto_is_measured_on_the_whole_pool(tmp_path, tiny_model_dir, tiny_pool,
                                                        tiny_pool_path):
    """train.max_length: auto resolves on the whole pool (not the selection) as score does,
    trains at that length and records it in train_metrics.json and the provenance."""
    from clusterft.modeling.hf import load_tokenizer
    from clusterft.modeling.lengths import example_lengths, resolve_max_length
    from clusterft.pipeline import provenance

    lengths = example_lengths(load_tokenizer(tiny_model_dir), tiny_pool)  # 36-48 tokens
    cfg = {**BASE_CFG, "max_length": "auto", "max_length_quantile": 0.5, "max_length_cap": 40}
    m, out = run_single(tmp_path, tiny_model_dir, tiny_pool_path, tiny_pool, "auto", cfg, n=16)
    want = resolve_max_length(lengths, 0.5, 64, 40)
    assert m["max_length"] == want == 40
    assert m["max_length_source"] == f"auto q0.5 of {len(tiny_pool)} examples, capped at 40 " \
                                     "(train.max_length_cap)"
    assert m["truncated_examples"] == sum(n > 40 for n in lengths[:16]) > 0
    assert json.loads((tmp_path / "auto.json").read_text())["max_length"] == 40
    recorded = provenance.read(tmp_path / "auto.json")["config"]
    assert recorded["max_length"] == 40 and recorded["max_length_source"] == m["max_length_source"]
    # the same weights as the resolved value written out
    _, fixed = run_single(tmp_path, tiny_model_dir, tiny_pool_path, tiny_pool, "fixed",
                          {**cfg, "max_length": 40}, n=16)
    wa, wb = weights(out), weights(fixed)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
