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
    assert len(cmds) == sum(int(n) for n in jobs.values()) > 50
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
