"""Where a stage output came from, and whether a stage's inputs belong together.

Every stage output gets a small JSON sidecar (``<file>.provenance.json`` beside a file,
``provenance.json`` inside a folder) holding the digest of the output itself, the stage and
config section that made it, its inputs (path + digest) and a *lineage*: named digests
inherited along the chain, e.g. ``pool`` (the pool that was scored or trained on),
``data[skills]`` (the prepare_data run that drew a pool and its benchmark items together),
``score_run`` (the one score run that wrote a features.npy and its scores.parquet),
``tokenizer`` (the scoring model's tokenizer).

Before any work a stage calls :func:`check_inputs`: each input must still be the file its
sidecar describes (a file swapped in without its own sidecar is caught here), and any two
inputs that carry the same lineage key must carry the same digest for it. A mismatch is
an InputError naming both files and the run each came from. Inputs without a sidecar (a
user's own pool, a hub model) are accepted; only what they share can be checked.

Digests are SHA-256 of the content (a folder: of its file names and contents, without the
sidecar and hidden files; files above ``SAMPLE_ABOVE`` bytes are digested by size and their first and last
``SAMPLE_BYTES``, so a 26 GB model folder is not read in full on every check).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import socket
from pathlib import Path
from typing import Any, Mapping

from clusterft.pipeline.errors import InputError

SIDECAR_SUFFIX = ".provenance.json"
DIR_SIDECAR = "provenance.json"
SAMPLE_ABOVE = 1 << 30
SAMPLE_BYTES = 8 << 20
#: files of a model folder that define its tokenizer (the digest behind lineage 'tokenizer')
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "merges.txt", "special_tokens_map.json")
#: folders inside outputs that are not part of them (checkpoints of a run in progress)
SKIP_DIRS = (".ckpt",)
#: files inside a folder output that report on how it was made, not what it is (the base
#: model's pretraining wall times): left out of its digest, so the same weights made on
#: another machine or scheduler (tests/test_slurm.py) have the same lineage downstream
SKIP_FILES = ("pretrain_metrics.json",)


def sidecar_path(path: str | os.PathLike) -> Path:
    p = Path(path)
    return p / DIR_SIDECAR if p.is_dir() else p.with_name(p.name + SIDECAR_SUFFIX)


def is_sidecar(path: str | os.PathLike) -> bool:
    """True for a provenance sidecar (tools that compare outputs skip them)."""
    name = Path(path).name
    return name.endswith(SIDECAR_SUFFIX) or name == DIR_SIDECAR


def _file_digest(h, path: Path) -> None:
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size > SAMPLE_ABOVE:
            h.update(f"sampled {size}".encode())
            h.update(f.read(SAMPLE_BYTES))
            f.seek(size - SAMPLE_BYTES)
            h.update(f.read(SAMPLE_BYTES))
            return
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)


def digest(path: str | os.PathLike, only: tuple[str, ...] | None = None) -> str:
    """SHA-256 (hex, 16 characters) of a file, or of a folder's files (names + contents,
    sidecar excluded); ``only``: just these file names of a folder."""
    p = Path(path)
    h = hashlib.sha256()
    if p.is_dir():
        # hidden names skipped: Snakemake's .snakemake_timestamp, half-written .tmp files
        files = sorted(q for q in p.rglob("*") if q.is_file() and not is_sidecar(q)
                       and q.name not in SKIP_FILES
                       and not any(part.endswith(SKIP_DIRS) or part.startswith(".")
                                   for part in q.relative_to(p).parts))
        if only is not None:
            files = [q for q in files if q.name in only]
        for q in files:
            h.update(str(q.relative_to(p)).encode() + b"\0")
            _file_digest(h, q)
            h.update(b"\0")
    else:
        _file_digest(h, p)
    return h.hexdigest()[:16]


def tokenizer_digest(model_dir: str | os.PathLike) -> str | None:
    """Digest of a model folder's tokenizer files, or None if it has none."""
    p = Path(model_dir)
    if not p.is_dir() or not any((p / n).exists() for n in TOKENIZER_FILES):
        return None
    return digest(p, only=TOKENIZER_FILES)


def read(path: str | os.PathLike) -> dict | None:
    """The sidecar of ``path``, or None when it has none."""
    sc = sidecar_path(path)
    if not sc.exists():
        return None
    try:
        return json.loads(sc.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise InputError(f"provenance sidecar is not readable JSON ({e}); delete it if "
                         f"{path} is your own file", path=str(sc)) from e


def describe(path: str | os.PathLike, prov: Mapping[str, Any] | None) -> str:
    """One line saying which run made ``path``."""
    if not prov:
        return f"{path} (no provenance: not made by clusterft)"
    made = ", ".join(f"{r} {i['path']}" for r, i in prov.get("inputs", {}).items())
    seed = f", seed {prov['seed']}" if prov.get("seed") is not None else ""
    return (f"{path} (written by {prov.get('stage')} as {prov.get('output')} at "
            f"{prov.get('created')} on {prov.get('host')}{seed}"
            + (f", from {made}" if made else "") + ")")


def _entry(path: str | os.PathLike, prov: Mapping[str, Any] | None) -> dict:
    return {"path": os.path.abspath(path), "digest": (prov or {}).get("digest") or digest(path)}


def lineage(path: str | os.PathLike, prov: Mapping[str, Any] | None = None,
            role: str | None = None) -> dict[str, dict]:
    """The lineage keys of an input: its sidecar's, plus the tokenizer of a model folder
    and (``role='pool'``) the pool's own digest."""
    out = dict((prov or {}).get("lineage", {}))
    if role == "pool":
        out["pool"] = _entry(path, prov)
    if role == "model":
        tok = tokenizer_digest(path)
        if tok is not None:
            out["tokenizer"] = {"path": os.path.abspath(path), "digest": tok}
    return out


def check_inputs(inputs: Mapping[str, str | os.PathLike | list], stage: str) -> dict[str, dict]:
    """Check a stage's inputs (role -> path or list of paths) belong together.

    Returns role -> {"paths", "provs", "lineage"} for :func:`write`. Raises InputError
    naming both files and the run each came from.
    """
    seen: dict[str, tuple[str, str, dict]] = {}  # key -> (path, role, its entry)
    info: dict[str, dict] = {}
    for role, paths in inputs.items():
        if paths is None:
            continue
        plist = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
        provs, lin_all = [], {}
        for p in plist:
            if not Path(p).exists():
                raise InputError(f"{stage}: {role} does not exist", path=str(p))
            prov = read(p)
            if prov is not None and prov.get("digest") != digest(p):
                raise InputError(
                    f"{stage}: {role} {p} is not the file its provenance sidecar "
                    f"{sidecar_path(p)} describes (digest {digest(p)} != recorded "
                    f"{prov.get('digest')}): it was replaced or edited after "
                    f"{describe(p, prov)}. Copy files together with their sidecars, or rerun "
                    f"the stage that makes it; delete the sidecar if the file is your own",
                    path=str(p))
            lin = lineage(p, prov, role if role in ("pool", "model") else None)
            for key, entry in lin.items():
                if key in seen and seen[key][2]["digest"] != entry["digest"]:
                    op, orole, oentry = seen[key]
                    raise InputError(
                        f"{stage}: {orole} {op} and {role} {p} do not belong together: they "
                        f"come from different {_KEY_WORDS.get(key.split('[')[0], key)} "
                        f"('{key}': {oentry['digest']} from {oentry['path']} vs "
                        f"{entry['digest']} from {entry['path']}). {orole}: "
                        f"{describe(op, read(op))}; {role}: {describe(p, prov)}. Pass files "
                        "of one run, or rerun the stages after the one that differs",
                        path=str(p), field=key)
                seen.setdefault(key, (str(p), role, entry))
                lin_all.setdefault(key, entry)
            provs.append(prov)
        info[role] = {"paths": [str(p) for p in plist], "provs": provs, "lineage": lin_all}
    return info


_KEY_WORDS = {"pool": "pools", "data": "prepare_data runs (a pool and its benchmark items)",
              "score_run": "score runs", "tokenizer": "tokenizers", "clusters": "cluster runs",
              "selection": "selections", "score_warmup": "score warm-ups"}


def write(outputs: Mapping[str, str | os.PathLike], stage: str, checked: Mapping[str, dict],
          *, inherit: tuple[str, ...] = (), own: Mapping[str, str] | None = None,
          config: Any = None, seed: int | None = None, run_key: str | None = None) -> None:
    """Write the sidecar of each output (role -> path) of one stage run.

    ``inherit``: input roles whose lineage the outputs carry on; ``own``: lineage key ->
    output role whose digest becomes that key (e.g. {"score_run": ...}); ``run_key``: a
    lineage key set to one digest of all the outputs together, so files written by the same
    run can be told from files of another.
    """
    digests = {role: digest(p) for role, p in outputs.items()}
    lin: dict[str, dict] = {}
    for role in inherit:
        if role in checked:
            lin.update(checked[role]["lineage"])
    for key, role in (own or {}).items():
        lin[key] = {"path": os.path.abspath(outputs[role]), "digest": digests[role]}
    if run_key:
        h = hashlib.sha256("".join(digests[r] for r in sorted(digests)).encode()).hexdigest()[:16]
        lin[run_key] = {"path": os.path.abspath(next(iter(outputs.values()))), "digest": h}
    inputs = {}
    for role, c in checked.items():
        for i, (p, prov) in enumerate(zip(c["paths"], c["provs"])):
            name = role if len(c["paths"]) == 1 else f"{role}[{i}]"
            inputs[name] = {"path": os.path.abspath(p), "digest": (prov or {}).get("digest") or digest(p)}
    now = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    for role, p in outputs.items():
        doc = {"stage": stage, "output": role, "path": os.path.abspath(p), "digest": digests[role],
               "created": now, "host": socket.gethostname(), "seed": seed,
               "config": config, "inputs": inputs, "lineage": lin}
        sc = sidecar_path(p)
        tmp = sc.with_name(f".{sc.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(doc, indent=2, default=str) + "\n", encoding="utf-8")
        os.replace(tmp, sc)
