"""The pinned stdlib snapshot: it verifies, tampering is caught, and the builders use it."""

from __future__ import annotations

import hashlib
import io
import json
import lzma
import os
import platform
import sys
import sysconfig
import tarfile
from pathlib import Path

import pytest

from clusterft.stages.data import corpus
from clusterft.pipeline.errors import InputError
from clusterft.pools import pycode, stdlib_snapshot as snap

ON_PINNED = platform.python_version() == snap.PYTHON_VERSION
MEMBER = "json/decoder.py"


def _members() -> dict[str, bytes]:
    with tarfile.open(snap.ARCHIVE, mode="r:xz") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar}


def _write(path: Path, members: dict[str, bytes]) -> str:
    """A tar.xz of `members` (fast preset); returns its sha256."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    raw = lzma.compress(buf.getvalue(), preset=0)
    path.write_bytes(raw)
    return hashlib.sha256(raw).hexdigest()


def test_shipped_snapshot_verifies():
    raw = snap.ARCHIVE.read_bytes()
    assert hashlib.sha256(raw).hexdigest() == snap.ARCHIVE_SHA256
    meta = json.loads(snap.MANIFEST.read_text(encoding="utf-8"))
    assert meta["name"] == snap.NAME and meta["python"] == snap.PYTHON_VERSION
    texts = snap.load()
    assert sorted(texts) == [e["path"] for e in meta["files"]]
    assert snap.TOPICS in texts and MEMBER in texts and len(texts) > 600
    # Exactly the files the builders read: both halves of the split, plus the topics.
    pool_files, corpus_files = pycode.stdlib_split()
    assert sorted(pool_files + corpus_files + [snap.TOPICS]) == sorted(texts)
    assert snap.info() == {"name": snap.NAME, "sha256": snap.ARCHIVE_SHA256}
    assert snap.main(["verify"]) == 0
    topics = snap.topics()
    assert len(topics) > 50 and "The \"assert\" statement" in topics["assert"]


def test_wrong_archive_hash(tmp_path):
    with pytest.raises(InputError, match="differs from the recorded") as ei:
        snap.load(snap.ARCHIVE, snap.MANIFEST, sha256="0" * 64)
    assert ei.value.path == str(snap.ARCHIVE) and "reinstall" in str(ei.value)
    # A damaged copy checked against the recorded hash.
    bad = tmp_path / "snap.tar.xz"
    raw = bytearray(snap.ARCHIVE.read_bytes())
    raw[len(raw) // 2] ^= 1
    bad.write_bytes(bytes(raw))
    with pytest.raises(InputError, match="differs from the recorded") as ei:
        snap.load(bad, snap.MANIFEST)
    assert ei.value.path == str(bad)
    with pytest.raises(InputError, match="cannot be read") as ei:
        snap.load(tmp_path / "missing.tar.xz", snap.MANIFEST)


def test_tampered_members(tmp_path):
    members = _members()
    # One changed byte in a member (the archive's own hash passed: only the manifest differs).
    changed = dict(members)
    changed[MEMBER] = changed[MEMBER].replace(b"JSONDecoder", b"JSONDecodeR", 1)
    sha = _write(tmp_path / "a.tar.xz", changed)
    with pytest.raises(InputError, match="differ from the manifest") as ei:
        snap.load(tmp_path / "a.tar.xz", snap.MANIFEST, sha)
    assert ei.value.path == f"{tmp_path / 'a.tar.xz'}[{MEMBER}]"
    assert "rebuild the snapshot" in str(ei.value)
    # A missing member.
    sha = _write(tmp_path / "b.tar.xz", {k: v for k, v in members.items() if k != MEMBER})
    with pytest.raises(InputError, match="is missing") as ei:
        snap.load(tmp_path / "b.tar.xz", snap.MANIFEST, sha)
    assert ei.value.path == f"{tmp_path / 'b.tar.xz'}[{MEMBER}]"
    # A member the manifest does not list.
    sha = _write(tmp_path / "c.tar.xz", {**members, "extra.py": b"x = 1\n"})
    with pytest.raises(InputError, match="not in the manifest") as ei:
        snap.load(tmp_path / "c.tar.xz", snap.MANIFEST, sha)
    assert ei.value.path == f"{tmp_path / 'c.tar.xz'}[extra.py]"
    # A manifest that is not JSON.
    (tmp_path / "m.json").write_text("{", encoding="utf-8")
    with pytest.raises(InputError, match="manifest is missing or malformed") as ei:
        snap.load(snap.ARCHIVE, tmp_path / "m.json")
    assert ei.value.path == str(tmp_path / "m.json")


def test_builders_do_not_read_the_running_stdlib(tmp_path, monkeypatch):
    """Pool functions and corpus documents come from the snapshot, whatever the interpreter."""
    cfg = pycode.DEFAULTS
    ccfg = corpus.merge_cfg({})
    real = pycode.stdlib_root()
    # What the builders read from this interpreter's own stdlib folder (the old behaviour).
    from_folder = (pycode.functions(cfg, root=real), corpus.stdlib_docs(ccfg, root=real))
    from pydoc_data.topics import topics as real_topics

    pycode._all_functions.cache_clear()
    normal = (pycode.functions(cfg), corpus.stdlib_docs(ccfg),
              corpus.topics_docs(ccfg["topics_chars"]))
    # Hide the running interpreter's stdlib: an empty stdlib folder, no pydoc_data.
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {"stdlib": str(empty)})
    monkeypatch.setattr(pycode, "stdlib_root", lambda: empty)
    monkeypatch.setitem(sys.modules, "pydoc_data", None)
    monkeypatch.setitem(sys.modules, "pydoc_data.topics", None)
    with pytest.raises(ImportError):
        import pydoc_data.topics  # noqa: F401
    pycode._all_functions.cache_clear()
    hidden = (pycode.functions(cfg), corpus.stdlib_docs(ccfg),
              corpus.topics_docs(ccfg["topics_chars"]))
    pycode._all_functions.cache_clear()
    assert hidden == normal
    assert len(hidden[0]) > 2000 and len(hidden[1]) > 50 and len(hidden[2]) > 50
    if ON_PINNED:  # the snapshot is this interpreter's stdlib: the same as before pinning
        assert normal[:2] == from_folder
        assert snap.topics() == real_topics


def test_prepare_checks_the_snapshot_first(tmp_path, monkeypatch):
    """A snapshot that does not match the recorded hash stops prepare_data and corpus."""
    from clusterft.stages.data.prepare import run_prepare_data

    monkeypatch.setattr(snap, "ARCHIVE_SHA256", "0" * 64)
    with pytest.raises(InputError, match="differs from the recorded") as ei:
        run_prepare_data("pycode", {}, tmp_path / "pool.jsonl", tmp_path / "labels.parquet",
                         tmp_path / "bench")
    assert ei.value.path == str(snap.ARCHIVE)
    with pytest.raises(InputError, match="differs from the recorded") as ei:
        corpus.run_corpus({}, tmp_path / "corpus.txt", [])
    assert ei.value.path == str(snap.ARCHIVE)
    assert sorted(tmp_path.iterdir()) == []


def test_root_reads_a_stdlib_folder(tmp_path):
    (tmp_path / "mod.py").write_text(
        'def f(a, b):\n    """Add two numbers."""\n    c = a + b\n    return c\n', encoding="utf-8")
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "x.py").write_text("", encoding="utf-8")
    assert pycode.stdlib_files(tmp_path) == ["mod.py"]
    fs = pycode.functions({**pycode.DEFAULTS, "corpus_fraction": 0.0}, root=tmp_path)
    assert [(f["file"], f["name"], f["params"]) for f in fs] == [("mod.py", "f", ["a", "b"])]


@pytest.mark.skipif(not ON_PINNED, reason=f"needs Python {snap.PYTHON_VERSION}'s stdlib")
def test_rebuild_reproduces_the_manifest(tmp_path):
    archive, manifest, sha = snap.build(pycode.stdlib_root(), tmp_path, snap.PYTHON_VERSION)
    assert manifest.read_bytes() == snap.MANIFEST.read_bytes()
    assert archive.name == snap.ARCHIVE.name
    assert snap.load(archive, manifest, sha) == snap.texts()
    with pytest.raises(InputError, match="not a Python stdlib folder"):
        snap.build(tmp_path / "nowhere", tmp_path / "out")


# The candidate pycode functions and the corpus's stdlib/topics documents, hashed; run by
# other interpreters with stand-ins for the packages this step imports but does not use.
_DIGEST = """
import hashlib, json, sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]
from clusterft.pools import pycode
from clusterft.stages.data import corpus
fs = pycode.functions(pycode.DEFAULTS)
docs = [corpus.stdlib_docs(corpus.DEFAULTS), corpus.topics_docs(corpus.DEFAULTS["topics_chars"])]
print(hashlib.sha256(json.dumps([fs, docs], sort_keys=True).encode()).hexdigest())
"""
_STUBS = {"numpy/__init__.py": "random = None\nndarray = object\n",
          "tqdm/__init__.py": "def tqdm(x=None, *a, **k):\n    return x\n",
          "yaml/__init__.py": ""}


def _other_pythons() -> list[Path]:
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    found = sorted(root.glob("3.1[0-9]*/bin/python")) if root.is_dir() else []
    return [p for p in found if not p.parent.parent.name.startswith(platform.python_version())]


@pytest.mark.skipif(not _other_pythons(), reason="no other Python 3.10+ interpreter installed")
def test_pool_and_corpus_inputs_are_the_same_on_other_pythons(tmp_path):
    """The README allows Python 3.10+: the pinned snapshot gives every interpreter the same
    pool functions and corpus documents (the parsing still runs on the interpreter's ast)."""
    import subprocess

    for rel, text in _STUBS.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    pkg = str(Path(pycode.__file__).resolve().parents[2])
    here = subprocess.run([sys.executable, "-c", _DIGEST, str(tmp_path / "none"), pkg],
                          capture_output=True, text=True, timeout=300)
    assert here.returncode == 0, here.stderr[-2000:]
    for py in _other_pythons():
        out = subprocess.run([str(py), "-I", "-c", _DIGEST, str(tmp_path), pkg],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, f"{py}: {out.stderr[-2000:]}"
        assert out.stdout == here.stdout, f"{py} builds other pool/corpus inputs"
