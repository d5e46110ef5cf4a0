"""The pinned Python stdlib snapshot the `pycode` pool and the corpus are built from.

The pycode pool, its benchmarks and the stdlib/language-reference part of the corpus are
built from source files of the Python stdlib. Read from the running interpreter, they
would change with its version, so they come from a snapshot of CPython 3.11.7's stdlib
shipped in the package (``clusterft/resources/<NAME>.tar.xz``): every file
`pycode.stdlib_files` selects (both halves of `pycode.stdlib_split`) plus
``pydoc_data/topics.py``.

`texts()` opens the archive in memory (nothing is extracted), checks it, and returns
``{relative path: text}``. Checks: the archive's sha256 equals `ARCHIVE_SHA256`; the member
list equals the manifest's (``<NAME>.json``: python version, sha256 and size per file);
every member's size and sha256 equal the manifest's. Any mismatch is an InputError that
names the archive and the member; reinstall clusterft, or rebuild the snapshot:

    python -m clusterft.pools.stdlib_snapshot build --stdlib /path/to/lib/python3.11 \
        --python 3.11.7 --out workflow/clusterft/resources

(then put the printed sha256 into `ARCHIVE_SHA256`). ``... verify`` checks the shipped one.
"""

from __future__ import annotations

import argparse
import ast
import functools
import hashlib
import io
import json
import lzma
import os
import platform
import tarfile
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

from clusterft.pipeline.errors import InputError

PYTHON_VERSION = "3.11.7"
NAME = f"python-{PYTHON_VERSION}-stdlib"
# sha256 of resources/<NAME>.tar.xz (printed by `build`).
ARCHIVE_SHA256 = "c33e7c234688541418a853e1f631ec84ceb93ca856cc84fe7a973ab74f6211c8"
RESOURCES = Path(__file__).resolve().parent.parent / "resources"
ARCHIVE = RESOURCES / f"{NAME}.tar.xz"
MANIFEST = RESOURCES / f"{NAME}.json"
TOPICS = "pydoc_data/topics.py"
_FIX = ("reinstall clusterft, or rebuild the snapshot (python -m "
        "clusterft.pools.stdlib_snapshot build) and update ARCHIVE_SHA256")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def snapshot_files(stdlib: str | os.PathLike) -> list[str]:
    """The files a snapshot of stdlib folder `stdlib` holds (sorted relative paths)."""
    from clusterft.pools.pycode import stdlib_files

    files = set(stdlib_files(Path(stdlib)))
    if (Path(stdlib) / TOPICS).is_file():
        files.add(TOPICS)
    return sorted(files)


def build(stdlib: str | os.PathLike, out_dir: str | os.PathLike,
          python: str = PYTHON_VERSION) -> tuple[Path, Path, str]:
    """Write ``python-<python>-stdlib.tar.xz`` and its ``.json`` manifest from a stdlib folder.

    Deterministic: sorted members, mtime 0, owner 0/0 without names, mode 0644, xz -9e.
    Returns (archive, manifest, archive sha256).
    """
    root, out = Path(stdlib), Path(out_dir)
    files = snapshot_files(root)
    if TOPICS not in files or len(files) < 100:
        raise InputError(f"not a Python stdlib folder (no {TOPICS} or too few .py files)",
                         path=str(root))
    buf = io.BytesIO()
    entries = []
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for rel in files:
            data = (root / rel).read_bytes()
            try:
                data.decode("utf-8")
            except UnicodeDecodeError as e:
                raise InputError("not UTF-8; the snapshot holds UTF-8 text only",
                                 path=str(root / rel)) from e
            info = tarfile.TarInfo(rel)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            tar.addfile(info, io.BytesIO(data))
            entries.append({"path": rel, "sha256": _sha256(data), "size": len(data)})
    xz = lzma.compress(buf.getvalue(), format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64,
                       preset=9 | lzma.PRESET_EXTREME)
    name = f"python-{python}-stdlib"
    out.mkdir(parents=True, exist_ok=True)
    archive, manifest = out / f"{name}.tar.xz", out / f"{name}.json"
    archive.write_bytes(xz)
    lines = ",\n".join("  " + json.dumps(e) for e in entries)
    head = json.dumps({"name": name, "python": python})[:-1]
    manifest.write_text(f'{head}, "files": [\n{lines}\n]}}\n', encoding="utf-8")
    return archive, manifest, _sha256(xz)


def load(archive: str | os.PathLike | None = None, manifest: str | os.PathLike | None = None,
         sha256: str | None = None) -> dict[str, str]:
    """Check a snapshot (see the module docstring) and return ``{relative path: text}``.

    Defaults: the shipped archive and manifest, and the recorded `ARCHIVE_SHA256`.
    """
    archive, manifest = Path(archive or ARCHIVE), Path(manifest or MANIFEST)
    sha256 = sha256 or ARCHIVE_SHA256
    try:
        raw = archive.read_bytes()
    except OSError as e:
        raise InputError(f"the stdlib snapshot cannot be read ({e.strerror}); {_FIX}",
                         path=str(archive)) from e
    got = _sha256(raw)
    if got != sha256:
        raise InputError(f"sha256 {got} differs from the recorded {sha256}: the stdlib "
                         f"snapshot was changed or damaged; {_FIX}", path=str(archive))
    try:
        meta = json.loads(manifest.read_text(encoding="utf-8"))
        want = {e["path"]: (e["sha256"], int(e["size"])) for e in meta["files"]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InputError(f"the stdlib snapshot manifest is missing or malformed ({e}); {_FIX}",
                         path=str(manifest)) from e
    out: dict[str, str] = {}
    try:
        with tarfile.open(fileobj=io.BytesIO(raw), mode="r:xz") as tar:
            for m in tar:
                where = f"{archive}[{m.name}]"
                if m.name not in want:
                    raise InputError(f"member not in the manifest {manifest}; {_FIX}", path=where)
                if not m.isfile() or m.name in out:
                    raise InputError(f"not a single regular file; {_FIX}", path=where)
                data = tar.extractfile(m).read()
                if (_sha256(data), len(data)) != want[m.name]:
                    raise InputError(f"sha256/size differ from the manifest {manifest}; {_FIX}",
                                     path=where)
                # As a text-mode read (Path.read_text) of the file would see it.
                out[m.name] = data.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
    except (tarfile.TarError, lzma.LZMAError, EOFError, UnicodeDecodeError) as e:
        raise InputError(f"the stdlib snapshot cannot be read ({e}); {_FIX}",
                         path=str(archive)) from e
    missing = sorted(set(want) - set(out))
    if missing:
        raise InputError(f"member listed in the manifest {manifest} is missing "
                         f"({len(missing)} missing in all); {_FIX}",
                         path=f"{archive}[{missing[0]}]")
    return out


@functools.lru_cache(maxsize=2)
def _checked(archive: str, manifest: str, sha256: str) -> Mapping[str, str]:
    return MappingProxyType(load(archive, manifest, sha256))


def texts() -> Mapping[str, str]:
    """The shipped snapshot, checked (once per process): ``{relative path: text}``, read-only."""
    return _checked(str(ARCHIVE), str(MANIFEST), ARCHIVE_SHA256)


def info() -> dict[str, str]:
    """Checks the shipped snapshot; what summaries record about it (name, archive sha256)."""
    texts()
    return {"name": NAME, "sha256": ARCHIVE_SHA256}


def topics(src: str | None = None) -> dict[str, str]:
    """The ``topics`` dict of ``pydoc_data/topics.py`` (the snapshot's unless `src`), parsed
    with `ast.literal_eval` (never executed)."""
    where = TOPICS if src is None else "<topics source>"
    tree = ast.parse(texts()[TOPICS] if src is None else src)
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name) and node.targets[0].id == "topics"):
            value = ast.literal_eval(node.value)
            if isinstance(value, dict):
                return value
    raise InputError("no `topics = {...}` dict literal found", path=where)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m clusterft.pools.stdlib_snapshot",
                                 description=__doc__.split("\n\n")[0], allow_abbrev=False)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", allow_abbrev=False, help="write <out>/python-<python>-stdlib.tar.xz + .json")
    b.add_argument("--stdlib", required=True, help="a stdlib folder (lib/python3.X)")
    b.add_argument("--python", default=platform.python_version(),
                   help="its Python version (default: the running one)")
    b.add_argument("--out", default=str(RESOURCES), help="output folder")
    sub.add_parser("verify", allow_abbrev=False, help="check the shipped snapshot")
    a = ap.parse_args(argv)
    if a.cmd == "build":
        archive, manifest, sha = build(a.stdlib, a.out, a.python)
        print(f"{archive}\n{manifest}\nsha256 {sha}")
    else:
        print(f"{NAME}: {len(texts())} files, sha256 {ARCHIVE_SHA256}: ok")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
