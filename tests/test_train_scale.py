"""Training at scale: the launch command (one rank, one node, SLURM nodes; SLURM's host list
syntax), a 2-"node" run on localhost (two torchrun agents, c10d rendezvous) against one node,
FSDP against DDP on 2 gloo ranks, gradient checkpointing against none, and the config checks
of the three options. Every run trains the real tiny model of conftest.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from clusterft.pipeline.errors import InputError
from clusterft.pipeline.launch import (job_resources, launch_args, launcher_shell, parse_hostlist, rdzv_port,
                              slurm_rendezvous, torchrun_args, train_layout)
from clusterft.stages.train import run_train, train_config
from test_train import BASE_CFG, make_selection, weights

ROOT = Path(__file__).resolve().parents[1]
# 32 examples, 8 per global step, 2 epochs: 8 optimiser steps, each cut in 2 ranks' halves.
CFG = {**BASE_CFG, "global_batch_size": 8, "epochs": 2}
N = 32
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@pytest.fixture(autouse=True)
def _keep_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


# --------------------------------------------------------------------------- the command

def test_layout_of_gpus_over_nodes():
    assert train_layout(1, 0) == (1, 1)
    assert train_layout(4, 0) == (1, 4)
    assert train_layout(4, 8) == (1, 4)  # fits one node
    assert train_layout(8, 4) == (2, 4)
    assert train_layout(8, 1) == (8, 1)
    with pytest.raises(InputError, match=r"train\.gpus_per_node.*8 GPUs do not split evenly"):
        train_layout(8, 3)
    with pytest.raises(InputError, match=r"train\.gpus_per_node"):
        train_layout(4, -1)


HOSTLISTS = {
    "node1": ["node1"],
    "gpu[07-09]": ["gpu07", "gpu08", "gpu09"],
    "gpu[1-2,10],login": ["gpu1", "gpu2", "gpu10", "login"],
    "ib-a[008-010]": ["ib-a008", "ib-a009", "ib-a010"],
    "r[1-2]n[01-02],x": ["r1n01", "r1n02", "r2n01", "r2n02", "x"],
    "c[3,1]": ["c3", "c1"],  # order as written (scontrol keeps it)
}


@pytest.mark.parametrize("spec", sorted(HOSTLISTS))
def test_slurm_host_list_syntax(spec):
    assert parse_hostlist(spec) == HOSTLISTS[spec]
    if shutil.which("scontrol"):  # SLURM's own expansion, where installed (no daemon needed)
        r = subprocess.run(["scontrol", "show", "hostnames", spec], capture_output=True,
                           text=True, timeout=30)
        assert r.stdout.split() == HOSTLISTS[spec], r.stderr


@pytest.mark.parametrize("bad", ["", "gpu[1-2", "gpu1-2]", "gpu[a-b]", "gpu[3-1]", "a,,b"])
def test_bad_host_lists_are_refused(bad):
    with pytest.raises(ValueError):
        parse_hostlist(bad)


SLURM_ENV = {"SLURM_JOB_ID": "81234", "SLURM_JOB_NODELIST": "gpu-a[07-08]"}


def test_exact_commands_for_one_node_and_two_nodes_of_four():
    assert launch_args(1) == ["python"]
    assert launch_args(4, 0) == launch_args(4, 4) == \
        ["torchrun", "--standalone", "--nnodes", "1", "--nproc-per-node", "4"]
    assert rdzv_port("81234") == 29500 + 1234 and rdzv_port("81234_7") == 29500 + 2347
    endpoint, rdzv_id = slurm_rendezvous(SLURM_ENV)
    assert (endpoint, rdzv_id) == ("gpu-a07:30734", "81234")
    assert launch_args(8, 4, endpoint, rdzv_id, gpu=True) == [
        "srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--cpus-per-task=4",
        "--kill-on-bad-exit=1", "--gpus-per-node=4",
        "torchrun", "--nnodes", "2", "--nproc-per-node", "4", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", "gpu-a07:30734", "--rdzv-id", "81234"]
    # the rule's shell text: the same words, the endpoint found inside the job
    assert launcher_shell(1) == "python"
    assert launcher_shell(4) == "torchrun --standalone --nnodes 1 --nproc-per-node 4"
    assert launcher_shell(8, 4, gpu=True) == (
        'CLUSTERFT_RDZV=$(python -m clusterft.pipeline.launch endpoint) && srun --nodes=2 --ntasks=2 '
        '--ntasks-per-node=1 --cpus-per-task=4 --kill-on-bad-exit=1 --gpus-per-node=4 torchrun '
        '--nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint "$CLUSTERFT_RDZV" '
        '--rdzv-id "$SLURM_JOB_ID"')
    with pytest.raises(InputError, match=r"train\.gpus_per_node.*SLURM"):
        slurm_rendezvous({})
    # the rule's resources: unchanged on one node, per node (and unset GPU count) on several
    unset = {"nodes": None, "tasks": None, "mpi": None, "gres": None, "tasks_per_gpu": None}
    assert job_resources(4, 0, gpu=True) == {"ranks_per_node": 4, "gpu": 4, **unset}
    assert job_resources(4, 0) == {"ranks_per_node": 4, "gpu": 0, **unset}
    assert job_resources(8, 4, gpu=True) == {"ranks_per_node": 4, "gpu": 0, "nodes": 2,
                                             "tasks": 2, "mpi": "srun", "gres": "gpu:4",
                                             "tasks_per_gpu": 0}
    assert job_resources(8, 4)["gres"] is None and job_resources(8, 4)["nodes"] == 2


def launch_cli(*args: str, env: dict) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return subprocess.run([sys.executable, "-m", "clusterft.pipeline.launch", *args], capture_output=True,
                          text=True, env={**clean, **env}, timeout=60)


def test_endpoint_inside_and_outside_a_job():
    """What the rule's shell runs in the job: the first node and the job's port; outside
    SLURM an error (exit 2) that stops the shell before srun."""
    r = launch_cli("endpoint", env=SLURM_ENV)
    assert r.returncode == 0 and r.stdout.strip() == "gpu-a07:30734", r.stderr
    r = launch_cli("command", "--gpus", "8", "--gpus-per-node", "4", env=SLURM_ENV)
    assert r.returncode == 0 and r.stdout.split() == launch_args(8, 4, "gpu-a07:30734", "81234")
    r = launch_cli("endpoint", env={})
    assert r.returncode == 2 and "train.gpus_per_node" in r.stderr and "SLURM_JOB_ID" in r.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # the job's python
    shell = subprocess.run(["bash", "-euo", "pipefail", "-c", launcher_shell(4, 2) + " echo RAN"],
                           capture_output=True, text=True, timeout=60, env=env)
    assert shell.returncode != 0 and "RAN" not in shell.stdout
    assert "train.gpus_per_node" in shell.stderr


def test_dry_run_prints_the_multi_node_command(tmp_path):
    """`snakemake -n -p` on the smoke config with gpus_per_node: 1 shows the 2-GPU time runs
    as srun + one torchrun agent per node, and leaves the 1-GPU runs plain python."""
    cfg = yaml.safe_load((ROOT / ".test" / "config.yaml").read_text())
    cfg["train"]["gpus_per_node"] = 1
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    r = subprocess.run([sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"),
                        "--directory", str(tmp_path), "--configfile", str(path), "--cores", "2",
                        "-n", "-p"], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    # each train job's block: from "rule train:" (or train_seeds: the smoke config fuses a
    # one-GPU run's seeds) to the blank line before the next job
    jobs = [b.split("\n\n", 1)[0]
            for b in re.split(r"rule train(?:_seeds)?:", r.stdout + r.stderr)[1:]]
    two = [b for b in jobs if "gpus=2," in b]
    one = [b for b in jobs if "gpus=1," in b]
    assert two and one, (r.stdout + r.stderr)[-3000:]

    def shell(block: str) -> str:
        return block.split("Shell command:", 1)[1].strip()

    multi = launcher_shell(2, 1) + " -m clusterft.stages.train"
    assert multi.startswith("CLUSTERFT_RDZV=$(python -m clusterft.pipeline.launch endpoint) && srun "
                            "--nodes=2 --ntasks=2 --ntasks-per-node=1")
    for b in two:
        assert shell(b).startswith(multi), shell(b)
        assert "nodes=2, tasks=2, mpi=srun" in b  # sbatch --nodes=2 --ntasks=2, own srun
    for b in one:
        assert shell(b).startswith("python -m clusterft.stages.train"), shell(b)
        assert "nodes=" not in b and "mpi=" not in b


def test_config_checks_name_the_field():
    with pytest.raises(InputError, match=r"train\.fsdp.*finetune: full"):
        train_config({"fsdp": True, "finetune": "lora"})
    with pytest.raises(InputError, match=r"train\.checkpoint_every.*FSDP"):
        train_config({"fsdp": True, "checkpoint_every": 5})
    with pytest.raises(InputError, match=r"train\.gpus_per_node"):
        train_config({"gpus_per_node": -2})
    with pytest.raises(InputError, match=r"train\.fsdp"):
        train_config({"fsdp": "yes"})
    assert train_config({"fsdp": True, "gradient_checkpointing": True})["fsdp"] is True
    from clusterft.plan.config import check_config

    cfg = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())  # time gpus [2, 4]
    cfg["train"]["gpus_per_node"] = 3
    with pytest.raises(InputError, match=r"train\.gpus_per_node.*sweep\.time\.gpus\[1\] = 4"):
        check_config(cfg)
    cfg["train"]["gpus_per_node"] = 2
    check_config(cfg)  # 2 and 4 split into nodes of 2
    cfg["models"]["small"]["train"] = {**cfg["models"]["small"].get("train", {}), "fsdp": True}
    with pytest.raises(InputError, match=r"models\.small\.train\.fsdp.*sweep\.accuracy\.gpus"):
        check_config(cfg)  # the accuracy runs use 1 GPU


def test_fsdp_on_one_rank_is_refused_before_loading(tmp_path, tiny_model_dir, tiny_pool,
                                                    tiny_pool_path):
    sel = make_selection(tmp_path / "sel.parquet", tiny_pool, 8)
    with pytest.raises(InputError, match=r"train\.fsdp.*at least 2 ranks"):
        run_train(tiny_model_dir, tiny_pool_path, sel, tmp_path / "o", tmp_path / "m.json",
                  "random", 0, {**CFG, "fsdp": True})
    assert not (tmp_path / "o").exists() and not (tmp_path / "m.json").exists()


# --------------------------------------------------------------------------- real runs

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_argv(launcher: list[str], model, pool, sel, out: Path, cfg: dict, threads: int,
               distribution: str = "balanced") -> list[str]:
    """A launcher's words (torchrun run as this interpreter's module) + the train command."""
    assert launcher[0] == "torchrun"
    return [sys.executable, "-m", "torch.distributed.run", *launcher[1:], "-m", "clusterft.stages.train",
            "--model", str(model), "--pool", str(pool), "--selection", str(sel), "--out", str(out),
            "--metrics", f"{out}.json", "--distribution", distribution, "--seed", "3",
            "--threads", str(threads), "--config", json.dumps(cfg)]


def run_all(argvs: list[list[str]], cwd: Path) -> None:
    """Start every command at once (the agents of one job), wait for all, bounded."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}, **OFFLINE}
    procs = [subprocess.Popen(a, cwd=cwd, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for a in argvs]
    try:
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]


@pytest.fixture(scope="module")
def one_node(tmp_path_factory, tiny_model_dir, tiny_pool, tiny_pool_path):
    """The reference: one node, 2 DDP ranks (torchrun --standalone), 1 thread each."""
    tmp = tmp_path_factory.mktemp("scale")
    sel = make_selection(tmp / "sel.parquet", tiny_pool, N)
    out = tmp / "one_node"
    run_all([train_argv(torchrun_args(1, 2), tiny_model_dir, tiny_pool_path, sel, out, CFG, 2)], tmp)
    return tmp, sel, out


def max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_two_agents_on_localhost_equal_one_node(one_node, tiny_model_dir, tiny_pool_path):
    """Two torchrun agents (--nnodes 2 --nproc-per-node 1, c10d rendezvous on 127.0.0.1),
    as srun would start them on two nodes, train what one node's 2 ranks train: the same
    ranks, batches and all-reduces, so the same weights (tolerance 1e-6; equal here)."""
    tmp, sel, ref = one_node
    out = tmp / "two_nodes"
    launcher = torchrun_args(2, 1, f"127.0.0.1:{free_port()}", "scale-test")
    assert launcher[:5] == ["torchrun", "--nnodes", "2", "--nproc-per-node", "1"]
    argv = train_argv(launcher, tiny_model_dir, tiny_pool_path, sel, out, CFG, 1)
    run_all([argv, argv], tmp)
    m, m_ref = json.loads(Path(f"{out}.json").read_text()), json.loads(Path(f"{ref}.json").read_text())
    assert m["world_size"] == m_ref["world_size"] == 2 and m["threads_per_rank"] == 1
    assert m["steps"] == m_ref["steps"] == N // 8 * 2
    assert m["per_rank_tokens_per_step"] == m_ref["per_rank_tokens_per_step"]
    assert np.allclose(m["loss_curve"], m_ref["loss_curve"], rtol=0, atol=1e-6)
    w, w_ref = weights(out), weights(ref)
    print(f"2 agents vs 1 node: max |dw| = {max_diff(w, w_ref):.3g}")
    assert max_diff(w, w_ref) <= 1e-6
    assert max_diff(w, weights(tiny_model_dir)) > 1e-3  # it trained


def test_fsdp_matches_ddp_on_two_gloo_ranks(one_node, tiny_model_dir, tiny_pool_path):
    """FSDP (fully_shard per decoder layer + root) on 2 CPU ranks trains the DDP reference's
    steps: the same loss curve (atol 1e-5) and weights (atol 1e-5; FSDP sums the micro-batch
    gradients after the reduce-scatter and the clip norm over shards, so rounding differs).
    Gradient checkpointing rides along: it must not change the result either."""
    tmp, sel, ref = one_node
    out = tmp / "fsdp"
    cfg = {**CFG, "fsdp": True, "gradient_checkpointing": True}
    run_all([train_argv(torchrun_args(1, 2), tiny_model_dir, tiny_pool_path, sel, out, cfg, 2)], tmp)
    m, m_ref = json.loads(Path(f"{out}.json").read_text()), json.loads(Path(f"{ref}.json").read_text())
    assert m["world_size"] == 2 and m["steps"] == m_ref["steps"]
    assert np.allclose(m["loss_curve"], m_ref["loss_curve"], rtol=0, atol=1e-5)
    w, w_ref = weights(out), weights(ref)
    assert max_diff(w, w_ref) <= 1e-5
    assert max_diff(w, weights(tiny_model_dir)) > 1e-3
    # DDP ranks hold every weight; FSDP ranks their shards (dim 0 split in two), together all
    from clusterft.stages.train import load_model

    total = sum(p.numel() for p in load_model(str(tiny_model_dir), train_config(CFG)).parameters())
    assert m_ref["trainable_params_per_rank"] == [total, total] and not m_ref["fsdp"]
    held = m["trainable_params_per_rank"]
    assert m["fsdp"] and m["gradient_checkpointing"] and sum(held) == total
    assert all(h < 0.6 * total for h in held), held
    print(f"FSDP vs DDP: max |dw| = {max_diff(w, w_ref):.3g}, max |dloss| = "
          f"{np.abs(np.subtract(m['loss_curve'], m_ref['loss_curve'])).max():.3g}, held {held}/{total}")


def test_gradient_checkpointing_gives_the_same_gradients_and_weights(tmp_path, tiny_model_dir,
                                                                     tiny_pool, tiny_pool_path):
    """Checkpointing is really on (the forward keeps under half the activations for the
    backward pass), and the gradient of a step and the weights after 8 steps equal those
    without (tolerance 1e-6; equal here), full fine-tuning and LoRA with dropout."""
    from clusterft.modeling.hf import load_tokenizer
    from clusterft.modeling.microbatch import CausalLMLoss, backward_step
    from clusterft.modeling.tokenize import Collator, encode_records
    from clusterft.stages.train import enable_gradient_checkpointing, load_model

    torch.set_num_threads(1)
    tok = load_tokenizer(tiny_model_dir)
    examples, _ = encode_records(tok, tiny_pool[:8], 64)
    grads, kept = [], []
    for ckpt in (False, True):
        model = load_model(str(tiny_model_dir), train_config(CFG))
        if ckpt:
            enable_gradient_checkpointing(model)
        saved = [0]  # activation elements the forward keeps for the backward pass

        def pack(t, saved=saved):
            saved[0] += t.numel()
            return t

        loss_fn = CausalLMLoss(model).train()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            backward_step(loss_fn, examples, Collator(tok.pad_token_id), -1)
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
        kept.append(saved[0])
    assert kept[1] < 0.5 * kept[0], kept  # checkpointed layers keep only their inputs
    assert max_diff(*grads) <= 1e-6
    sel = make_selection(tmp_path / "sel.parquet", tiny_pool, N)
    lora = {"finetune": "lora", "merge_lora": True, "lr": 1e-2, "lora": {"r": 4, "alpha": 8, "dropout": 0.1,
                                                     "target_modules": ["q_proj", "v_proj"]}}
    for name, extra in (("full", {}), ("lora", lora)):  # LoRA: dropout replayed in the recompute
        outs = []
        for ckpt in (False, True):
            out = tmp_path / f"{name}{int(ckpt)}"
            m = run_train(tiny_model_dir, tiny_pool_path, sel, out, tmp_path / f"{out.name}.json",
                          "balanced", 3, {**CFG, **extra, "gradient_checkpointing": ckpt},
                          job_threads=1)
            assert m["gradient_checkpointing"] is ckpt
            outs.append(weights(out))
        print(f"checkpointing ({name}): max |dgrad| = {max_diff(*grads):.3g}, "
              f"max |dw| = {max_diff(*outs):.3g}, activations kept {kept}")
        assert max_diff(*outs) <= 1e-6
        assert max_diff(outs[0], weights(tiny_model_dir)) > 1e-3
