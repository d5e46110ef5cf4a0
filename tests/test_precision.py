"""Precision on CPUs with and without native bf16: detection, the embedded default's runs all
resolve to fp32 where bf16 would be emulated, and bf16 asked for there warns (config check,
dry run, and at run time)."""

from __future__ import annotations

import json
import re
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml

from clusterft.pipeline import hardware
from clusterft.stages import models
from clusterft.modeling import precision
from clusterft.plan.config import config_warnings, emulated_bf16_fields, load_config

ROOT = Path(__file__).resolve().parents[1]
FORCED_AVX2 = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}

CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse2 avx avx2 fma

processor\t: 1
model name\t: other
flags\t\t: avx512_bf16
"""


def test_cpuinfo_first_block_flags_and_model(tmp_path: Path) -> None:
    p = tmp_path / "cpuinfo"
    p.write_text(CPUINFO)
    info = hardware._cpuinfo(str(p))
    assert hardware.cpu_model(info) == "AMD EPYC 7B13"
    assert hardware.cpu_flags(info) == frozenset({"fpu", "sse2", "avx", "avx2", "fma"})
    assert hardware.native_bf16_cpu(hardware.cpu_flags(info), env={}) is False
    assert hardware._cpuinfo(str(tmp_path / "missing")) == {}
    assert hardware.cpu_flags({}) is None


@pytest.mark.parametrize("flags,env,expect", [
    ({"avx2", "avx512_bf16"}, {}, True),
    ({"avx2", "amx_bf16"}, {}, True),
    ({"fp", "asimd", "bf16"}, {}, True),  # Arm
    ({"avx2", "avx512f"}, {}, False),
    ({"avx2", "avx512_bf16"}, {"ONEDNN_MAX_CPU_ISA": "avx2"}, False),
    ({"avx2", "avx512_bf16"}, {"ATEN_CPU_CAPABILITY": "avx2"}, False),
    ({"avx2", "avx512_bf16"}, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}, True),
    ({"avx2", "avx512_bf16"}, {"DNNL_MAX_CPU_ISA": "AVX2"}, False),
])
def test_native_bf16_from_flags_and_isa_caps(flags, env, expect) -> None:
    assert hardware.native_bf16_cpu(frozenset(flags), env) is expect


def test_unknown_flags_leave_the_answer_to_torch_and_warn_about_nothing(monkeypatch) -> None:
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.setattr(hardware, "cpu_flags", lambda info=None: None)
    assert hardware.native_bf16_cpu(None, {}) is None
    cfg = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    cfg["models"]["large"]["pretrain"]["precision"] = "bf16"
    assert emulated_bf16_fields(cfg) == []
    assert precision.native_bf16("cpu") in (True, False)  # torch's own probes decide


def test_forced_avx2_reports_no_native_bf16_and_bf16_warns(monkeypatch) -> None:
    for k, v in FORCED_AVX2.items():
        monkeypatch.setenv(k, v)
    assert precision.native_bf16("cpu") is False
    assert hardware.describe()["native_bf16"] is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert precision.resolve_precision("auto", "cpu") == "fp32"
        assert precision.resolve_precision("fp32", "cpu") == "fp32"
    with pytest.warns(UserWarning, match=r"train\.precision: bf16 on a CPU that emulates "
                                         r"bfloat16 \(ONEDNN_MAX_CPU_ISA=AVX2\)"):
        assert precision.resolve_precision("bf16", "cpu", field="train.precision") == "bf16"


def _dry_run(cwd: Path, *args: str, env: dict) -> subprocess.CompletedProcess:
    full = {**os.environ, **env,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run([sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"),
                           "-n", "-p", "--directory", str(cwd), *args], capture_output=True,
                          text=True, cwd=cwd, env=full, timeout=600)


def test_embedded_config_has_no_bf16_and_resolves_every_run_to_fp32(tmp_path, monkeypatch):
    """Native bf16 reported absent (the forced-AVX2 path): every pretraining and every train
    job of config/config.yaml resolves to fp32, and nothing warns."""
    for k, v in FORCED_AVX2.items():
        monkeypatch.setenv(k, v)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config(ROOT / "config" / "config.yaml")
    assert emulated_bf16_fields(cfg) == []
    for name, m in cfg["models"].items():
        pre = {**models.DEFAULTS["pretrain"], **(m.get("pretrain") or {})}
        assert precision.resolve_precision(pre["precision"], "cpu") == "fp32", name
    out = _dry_run(tmp_path, "--configfile", str(ROOT / "config" / "config.yaml"),
                   env=FORCED_AVX2)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "emulates bfloat16" not in out.stdout + out.stderr
    cmds = [ln for ln in out.stdout.splitlines() if "clusterft.stages.train" in ln]
    # every train job of the sweep: train (time runs) and train_seeds (a run's 3 seeds)
    jobs = dict(re.findall(r"^(train\w*)\s+(\d+)\s*$", out.stdout + out.stderr, re.M))
    assert set(jobs) == {"train", "train_seeds"}
    assert len(cmds) == sum(int(n) for n in jobs.values()) > 30
    from clusterft.stages.train import DEFAULTS as TRAIN

    for c in cmds:
        js = json.loads(c.split("--config ", 1)[1].split(" > ", 1)[0].strip("'"))
        assert precision.resolve_precision(js.get("precision", TRAIN["precision"]), "cpu") == "fp32"


def test_bf16_on_an_emulating_cpu_warns_at_config_check_and_in_the_dry_run(tmp_path, monkeypatch):
    for k, v in FORCED_AVX2.items():
        monkeypatch.setenv(k, v)
    import clusterft.plan.config

    monkeypatch.setattr(clusterft.plan.config, "cuda_visible", lambda: False)  # a GPU node too
    cfg = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    cfg["models"]["large"]["pretrain"]["precision"] = "bf16"
    cfg["models"]["large"]["train"] = {"precision": "bf16"}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    with pytest.warns(UserWarning) as rec:
        load_config(path)
    msgs = [str(w.message) for w in rec]
    assert msgs == config_warnings(cfg, source=str(path))
    line = next(i for i, ln in enumerate(path.read_text().splitlines(), 1) if "bf16" in ln)
    assert any(f"{path}, line {line}: models.large.pretrain.precision: bf16" in m for m in msgs), msgs
    assert any("models.large.train.precision" in m for m in msgs), msgs
    assert not any("models.small" in m for m in msgs)
    monkeypatch.setattr(clusterft.plan.config, "cuda_visible", lambda: True)  # pretraining: CPU
    assert emulated_bf16_fields(cfg) == ["models.large.pretrain.precision"]
    out = _dry_run(tmp_path, "--configfile", str(path), env=FORCED_AVX2)
    assert out.returncode == 0, out.stderr[-3000:]  # a warning, not an error
    assert "models.large.pretrain.precision: bf16 on a CPU that emulates bfloat16" in out.stderr
    # a CPU with native bf16 (no cap, flags say so) does not warn
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    monkeypatch.setattr(hardware, "cpu_flags", lambda info=None: frozenset({"avx512_bf16"}))
    assert emulated_bf16_fields(cfg) == []


def _precision_paths(cfg: dict) -> set[tuple]:
    """Per model: what the precision code paths depend on (pretrain precision, train
    precision, padding multiple), after the train section's overrides."""
    from clusterft.stages.train import DEFAULTS as TRAIN

    out = set()
    for m in cfg["models"].values():
        pre = {**models.DEFAULTS["pretrain"], **(m.get("pretrain") or {})}
        tr = {**TRAIN, **(cfg.get("train") or {}), **(m.get("train") or {})}
        out.add((pre["precision"], tr["precision"], tr["pad_to_multiple_of"]))
    return out


def test_smoke_config_walks_the_embedded_precision_paths() -> None:
    """CI runs the smoke config: every precision path of the embedded default must be in it,
    so a config that is slow on CI's CPU is caught there."""
    emb = _precision_paths(yaml.safe_load((ROOT / "config" / "config.yaml").read_text()))
    smoke = _precision_paths(yaml.safe_load((ROOT / ".test" / "config.yaml").read_text()))
    assert emb <= smoke, f"embedded paths {emb - smoke} are missing from .test/config.yaml"


# --------------------------------------------------------------- score and features precision

def _score_grads(model, tok, records, cfg: dict, method: str = "hook"):
    """(per-example LoRA gradients [B, D], projected rows, Scoring.precision) of one batch
    with every lora_B set off zero (so every gradient is non-zero), in eval mode."""
    import torch

    from clusterft.modeling.tokenize import collate
    from clusterft.stages.score import (_encode_all, lora_parameters, merge_cfg,
                                        per_example_grads, project_batch, scoring_model)

    cfg = merge_cfg(cfg)
    batch = collate(_encode_all(tok, records, cfg)[0], tok.pad_token_id)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bf16 on a CPU that emulates it warns, rightly
        with scoring_model(model, cfg, 0) as sc:
            sc.model.eval()
            gen = torch.Generator().manual_seed(0)
            with torch.no_grad():
                for name, p in lora_parameters(sc.model):
                    if "lora_B" in name:
                        p.copy_(0.05 * torch.randn(p.shape, generator=gen))
            g = per_example_grads(sc.model, batch, method, False, cfg["precision"])
            rows, _ = project_batch(sc.model, batch, {**cfg, "method": method}, sc.proj)
            return g, rows, sc.precision


@pytest.mark.parametrize("projection,method", [("rademacher", "hook"), ("kronecker", "hook"),
                                               ("kronecker", "func")])
def test_score_bf16_autocast_on_cpu_gives_the_fp32_gradients_closely(
        tiny_model_dir, tiny_pool, projection, method) -> None:
    """score.precision bf16 on a CPU: the forward passes under bfloat16 autocast, the
    per-example gradients and their projection float32 and close to fp32's: cosine >= 0.999
    per example and relative error <= 3% (measured: cosine 0.99995, 0.7%, on the tiny
    Llama); not equal (autocast did run)."""
    import torch

    from clusterft.modeling.hf import load_causal_lm, load_tokenizer

    model, tok = load_causal_lm(tiny_model_dir), load_tokenizer(tiny_model_dir)
    cfg = {"dim": 64, "projection": projection, "device": "cpu"}
    g32, r32, p32 = _score_grads(model, tok, tiny_pool[:12], {**cfg, "precision": "fp32"}, method)
    g16, r16, p16 = _score_grads(model, tok, tiny_pool[:12], {**cfg, "precision": "bf16"}, method)
    assert (p32, p16) == ("fp32", "bf16")
    assert g16.dtype == r16.dtype == torch.float32
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the base as it was
    cos = torch.nn.functional.cosine_similarity
    assert cos(g32, g16).min() >= 0.999 and cos(r32, r16).min() >= 0.999
    rel = float((g32 - g16).norm() / g32.norm())
    assert 0 < rel <= 0.03, rel


def test_score_auto_is_fp32_on_cpu_and_computes_as_fp32(tiny_model_dir, tiny_pool) -> None:
    """auto resolves to fp32 on a CPU (whatever its bf16 support): the base loads float32
    and the features are fp32's, byte for byte; bf16 (warm-up, loss passes and gradient
    pass under autocast) runs to features close to them."""
    import numpy as np
    import torch

    from clusterft.modeling.hf import load_tokenizer
    from clusterft.stages.score import compute_features_info, merge_cfg
    from clusterft.stages.score.model import load_base

    assert precision.resolve_precision("auto", "cpu") == "fp32"
    assert merge_cfg(None)["precision"] == "auto"
    with pytest.raises(Exception, match="score.precision"):
        merge_cfg({"precision": "fp16"})
    cfg = {"dim": 32, "warmup_steps": 4, "batch_size": 8, "loss_points": 3, "device": "cpu"}
    base = load_base(tiny_model_dir, merge_cfg(cfg))
    assert {p.dtype for p in base.parameters()} == {torch.float32}
    tok = load_tokenizer(tiny_model_dir)
    out = {}
    for p in ("auto", "fp32", "bf16"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            f, s, n, info = compute_features_info(base, tok, tiny_pool[:24],
                                                  {**cfg, "precision": p}, seed=3)
        out[p] = (f, info)
    assert out["auto"][1]["precision"] == "fp32" and out["bf16"][1]["precision"] == "bf16"
    assert out["auto"][0].tobytes() == out["fp32"][0].tobytes()
    f32, f16 = out["fp32"][0], out["bf16"][0]
    assert f16.dtype == np.float32 and not np.array_equal(f32, f16)
    assert (f32 * f16).sum(1).min() >= 0.99  # unit rows: the cosine per example
    traj32, traj16 = out["fp32"][1]["loss_trajectories"], out["bf16"][1]["loss_trajectories"]
    assert np.allclose(traj32, traj16, rtol=0.02)


def test_dtype_decision_for_a_cuda_gpu_with_bf16(monkeypatch, tiny_model_dir, tiny_pool) -> None:
    """A CUDA GPU with bf16 (mocked: no GPU needed): auto resolves to bf16, the frozen base
    of score, features and LoRA training loads in bfloat16 straight onto the device, a full
    fine-tune's in float32; a CPU stays float32. On a bfloat16 base peft keeps the LoRA
    weights in float32, and the gradients formed from bf16 activations are float32."""
    import torch

    from clusterft.modeling import hf
    from clusterft.modeling.hf import load_causal_lm, load_tokenizer
    from clusterft.stages.features import representations
    from clusterft.stages.score import lora_parameters, merge_cfg, scoring_model
    from clusterft.stages.score import model as score_model

    monkeypatch.setattr(precision, "native_bf16", lambda device: torch.device(device).type == "cuda")
    assert precision.resolve_precision("auto", "cuda:0") == "bf16"
    assert precision.resolve_precision("fp32", "cuda:0") == "fp32"
    assert precision.base_dtype("bf16", "cuda:0", "lora") is torch.bfloat16
    assert precision.base_dtype("bf16", "cuda:0", "full") is torch.float32
    assert precision.base_dtype("fp32", "cuda:0", "lora") is torch.float32
    assert precision.base_dtype("bf16", "cpu", "lora") is torch.float32
    calls = []
    monkeypatch.setattr(hf, "load_causal_lm", lambda path, **kw: calls.append(kw))
    monkeypatch.setattr(score_model, "resolve_device", lambda spec, field: "cuda:0")
    monkeypatch.setattr(representations, "resolve_device", lambda spec, field: "cuda:0")
    score_model.load_base("m", merge_cfg({"precision": "auto"}))
    score_model.load_base("m", merge_cfg({"precision": "fp32"}))
    assert calls == [{"dtype": torch.bfloat16, "device": torch.device("cuda:0")},
                     {"dtype": torch.float32, "device": torch.device("cuda:0")}]
    assert representations._load_kwargs(representations.merge_cfg(None)) == {
        "dtype": torch.bfloat16, "device": torch.device("cuda:0")}
    monkeypatch.undo()
    # what the GPU path holds, on the CPU: a bfloat16 base, float32 adapters and gradients
    base = load_causal_lm(tiny_model_dir, dtype=torch.bfloat16, device="cpu")
    tok = load_tokenizer(tiny_model_dir)
    cfg = {"dim": 32, "projection": "kronecker", "precision": "bf16", "device": "cpu"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with scoring_model(base, merge_cfg(cfg), 0) as sc:
            lora = lora_parameters(sc.model)
            assert lora and {p.dtype for _, p in lora} == {torch.float32}
            frozen = {p.dtype for n, p in sc.model.named_parameters() if "lora_" not in n}
            assert frozen == {torch.bfloat16}
    g16, r16, _ = _score_grads(base, tok, tiny_pool[:8], cfg)
    g32, r32, _ = _score_grads(load_causal_lm(tiny_model_dir), tok, tiny_pool[:8],
                               {**cfg, "precision": "fp32"})
    assert g16.dtype == r16.dtype == torch.float32
    assert torch.nn.functional.cosine_similarity(r32, r16).min() >= 0.99


def test_embedding_features_bf16_autocast_on_cpu_and_auto_is_fp32(tiny_model_dir, tiny_pool):
    """features.precision: auto is fp32 on a CPU (the same bytes), bf16 autocast gives rows
    within cosine 0.999 of fp32's."""
    import numpy as np

    from clusterft.modeling.hf import load_causal_lm, load_tokenizer
    from clusterft.stages.features.representations import embedding_features, merge_cfg

    model, tok = load_causal_lm(tiny_model_dir), load_tokenizer(tiny_model_dir)
    rows = {}
    for p in ("auto", "fp32", "bf16"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rows[p] = embedding_features(model, tok, tiny_pool[:16],
                                         {"precision": p, "device": "cpu", "batch_size": 8})
    assert rows["auto"].tobytes() == rows["fp32"].tobytes()
    assert not np.array_equal(rows["fp32"], rows["bf16"])
    assert (rows["fp32"] * rows["bf16"]).sum(1).min() >= 0.999
    with pytest.raises(Exception, match="features.precision"):
        merge_cfg({"precision": "half"})


def test_score_and_features_bf16_on_an_emulating_cpu_are_named_at_config_check(monkeypatch):
    """score.precision and features.precision bf16 warn like train's where their jobs
    would run on a CPU that emulates bf16 (their own device setting)."""
    import clusterft.plan.config

    monkeypatch.setattr(clusterft.plan.config, "native_bf16_cpu", lambda *a, **k: False)
    monkeypatch.setattr(clusterft.plan.config, "cuda_visible", lambda: False)
    cfg = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    assert emulated_bf16_fields(cfg) == []
    cfg["score"]["precision"] = "bf16"
    cfg["features"] = {"precision": "bf16", "device": "cuda"}  # a GPU job: not on this CPU
    assert emulated_bf16_fields(cfg) == ["score.precision"]
