"""`pycode`: functions with docstrings from the (pinned) Python stdlib.

User message = signature + the docstring's first paragraph (as code); assistant = the body
(everything after the docstring, dedented to one 4-space level, comments kept). Functions
are short (character caps) so that an example fits a 128-192 token context of a small
byte-level BPE. Labels = top-level module name (``email``, ``asyncio``, ...).

The stdlib files are split once, by a hash of their relative path, into a pycode part and
a corpus part (`stdlib_split`); `clusterft.stages.data.corpus` only reads the corpus part, so the base
model never sees pool or benchmark functions. Test suites, idlelib, site-packages and the
like are skipped. Files and functions are visited in sorted, deterministic order. The files
come from the stdlib snapshot shipped in the package (`stdlib_snapshot`: CPython 3.11.7's
stdlib, checked against recorded sha256s before anything is built), not from the running
interpreter, so the pool does not change with the interpreter's version (the candidate
functions come out the same on Python 3.10 to 3.13); `root=` reads a stdlib folder instead.

Benchmarks (held-out functions, drawn first, never in the pool):
- ``pycode_body_mc``: pick the right body for a signature + docstring among 4 short bodies
  of held-out functions of similar length; the 4 functions of a group share the same
  choices, so ignoring the prompt scores exactly 1/4.
- ``pycode_args_mc``: pick the right body among the true body and 3 copies whose
  parameter names were consistently renamed to parameter names of other functions
  (tests whether the model ties the body to the signature).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import io
import os
import re
import sysconfig
import textwrap
import tokenize
from pathlib import Path

import numpy as np

from clusterft.pipeline.errors import InputError
from clusterft.modeling.prompt import render_prompt
from clusterft.pools import VAL_STREAM
from clusterft.pools import Built
from clusterft.pools import built_pool
from clusterft.pools import make_record
from clusterft.pools import select_pool
from clusterft.pools import stdlib_snapshot
from clusterft.pools import val_count
from clusterft.pools import val_id
from clusterft.pools import words

DEFAULTS: dict = {
    # Pool size cap (examples); the stdlib has fewer short functions than that at most caps.
    "n": 3000,
    # Error out if fewer than this many pool examples remain after the caps and checks.
    "min_examples": 2000,
    # Benchmark items per task.
    "items_per_task": 200,
    # Validation items per task for LESS / RDS+ (<task>.val.jsonl; see skills): from the
    # held-out functions no test item uses, which are few (about 40 at 200 items per task:
    # pycode_args_mc gets ~11 and pycode_body_mc fills its groups of 4 with longer bodies
    # once the short ones run out; the summary's val counts say how many). 0 disables them.
    "val_per_task": 16,
    # Longest function body (characters, after dedent).
    "max_body_chars": 350,
    # Longest docstring first paragraph (characters).
    "max_doc_chars": 200,
    # Longest user message + body (characters); ~500 chars is ~150-190 tokens of a 2k BPE.
    "max_chars": 500,
    # Longest body (characters) of the functions used by pycode_body_mc (short bodies tie
    # the docstring to the code most directly).
    "body_mc_max_chars": 120,
    # Fraction of stdlib files (by hash of the relative path) given to the corpus instead.
    "corpus_fraction": 0.2,
}

SKIP_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "dist-packages",
                       "turtledemo", "ensurepip", "__pycache__", "pydoc_data", "lib-dynload",
                       "venv", "__phello__"})
TRIVIAL_BODIES = frozenset({"pass", "...", "raise NotImplementedError",
                            "raise NotImplementedError()", "return", "return None"})


def stdlib_root() -> Path:
    """The running interpreter's stdlib folder (what `stdlib_snapshot build` reads)."""
    return Path(sysconfig.get_paths()["stdlib"])


def _selected(rel: str) -> bool:
    """The walk's rules of `stdlib_files` applied to one relative path."""
    *dirs, name = rel.split("/")
    return (name.endswith(".py") and not name.startswith("test_")
            and not any(d in SKIP_DIRS or d.startswith("config-") for d in dirs))


def stdlib_files(root: Path | None = None) -> list[str]:
    """Relative paths of the stdlib's .py files (sorted), skipping tests and tools.

    From the pinned snapshot, or from the stdlib folder `root` if given.
    """
    if root is None:
        return sorted(rel for rel in stdlib_snapshot.texts() if _selected(rel))
    root = Path(root)
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS and not x.startswith("config-"))
        for f in files:
            if f.endswith(".py") and not f.startswith("test_"):
                out.append(os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/"))
    return sorted(out)


def read_source(rel: str, root: Path | None = None) -> str | None:
    """Text of stdlib file `rel` (the snapshot's, or under `root`); None if unreadable."""
    if root is None:
        return stdlib_snapshot.texts().get(rel)
    try:
        return (Path(root) / rel).read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def _to_corpus(rel: str, fraction: float) -> bool:
    h = int(hashlib.sha1(rel.encode("utf-8")).hexdigest()[:12], 16) / float(1 << 48)
    return h < fraction


def stdlib_split(fraction: float = DEFAULTS["corpus_fraction"],
                 root: Path | None = None) -> tuple[list[str], list[str]]:
    """(pycode files, corpus files): a fixed split by hash of the relative path."""
    files = stdlib_files(root)
    corpus = [f for f in files if _to_corpus(f, fraction)]
    return [f for f in files if not _to_corpus(f, fraction)], corpus


def module_label(rel: str) -> str:
    """Top-level module of a stdlib file: 'email/utils.py' -> 'email'."""
    first = rel.split("/")[0]
    return first[:-3] if first.endswith(".py") else first


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    ret = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
    kw = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    return f"{kw} {node.name}({ast.unparse(node.args)}){ret}:"


def _param_names(node: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    a = node.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
    names += [x.arg for x in (a.vararg, a.kwarg) if x is not None]
    return [n for n in names if n not in ("self", "cls")]


def extract_functions(rel: str, src: str, cfg: dict) -> list[dict]:
    """Short documented functions of one file, in source order."""
    try:
        tree = ast.parse(src)
    except (SyntaxError, ValueError):
        return []
    lines = src.splitlines()
    out = []
    nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for node in sorted(nodes, key=lambda n: (n.lineno, n.col_offset)):
        doc = ast.get_docstring(node)
        if not doc or len(node.body) < 2 or node.body[0].end_lineno >= node.body[1].lineno:
            continue
        doc = " ".join(doc.strip().split("\n\n")[0].split())
        if not doc or '"""' in doc or "\\" in doc or len(doc) > cfg["max_doc_chars"]:
            continue
        start = node.body[1].lineno - 1
        # Comments between the docstring and the first statement belong to the body too.
        while start - 1 > node.body[0].end_lineno - 1 and lines[start - 1].strip().startswith("#"):
            start -= 1
        body_src = textwrap.dedent("\n".join(lines[start:node.end_lineno]))
        body_lines = [ln.rstrip() for ln in body_src.splitlines()]
        body_lines = [ln for ln in body_lines if ln]
        if not body_lines or " ".join(body_lines).strip() in TRIVIAL_BODIES:
            continue
        if body_lines[0][0].isspace():  # a multi-line string at column 0 blocked the dedent
            continue
        body = "\n".join("    " + ln for ln in body_lines)
        if "\t" in body or len(body) > cfg["max_body_chars"]:
            continue
        user = f'{_signature(node)}\n    """{doc}"""'
        if len(user) + len(body) > cfg["max_chars"]:
            continue
        out.append({"file": rel, "module": module_label(rel), "name": node.name, "user": user,
                    "body": body, "params": _param_names(node)})
    return out


@functools.lru_cache(maxsize=4)
def _all_functions(root: str | None, key: tuple) -> tuple[dict, ...]:
    cfg = dict(key)
    folder = None if root is None else Path(root)
    files, _ = stdlib_split(cfg["corpus_fraction"], folder)
    funcs: list[dict] = []
    seen: set[str] = set()
    for rel in files:
        src = read_source(rel, folder)
        if src is None:
            continue
        for f in extract_functions(rel, src, cfg):
            # One function per (docstring + body) and per (signature + docstring): copies
            # such as io/_pyio or a method repeated across classes would otherwise put a
            # benchmark prompt or body into the pool under another name.
            keys = (" ".join(words(f["user"].split("\n", 1)[1] + " " + f["body"])),
                    " ".join(words(f["user"])))
            if seen & set(keys):
                continue
            seen.update(keys)
            funcs.append(f)
    return tuple(funcs)


def functions(cfg: dict, root: Path | None = None) -> list[dict]:
    """All candidate functions of the pycode half, deduplicated (see _all_functions)."""
    keys = ("max_body_chars", "max_doc_chars", "max_chars", "corpus_fraction")
    key = tuple((k, cfg[k]) for k in keys)
    return [dict(f) for f in _all_functions(None if root is None else str(root), key)]


def rename_params(body: str, mapping: dict[str, str]) -> str | None:
    """Rename parameter NAME tokens in a body (not attributes, not keyword-argument names).

    Returns None if the body cannot be tokenised or nothing was renamed.
    """
    code = textwrap.dedent(body) + "\n"
    try:
        toks = list(tokenize.generate_tokens(io.StringIO(code).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return None
    depth = 0
    edits: list[tuple[int, int, str, str]] = []
    for i, t in enumerate(toks):
        if t.type == tokenize.OP:
            depth += t.string in "([{"
            depth -= t.string in ")]}"
            continue
        if t.type != tokenize.NAME or t.string not in mapping:
            continue
        prev = toks[i - 1].string if i else ""
        nxt = toks[i + 1].string if i + 1 < len(toks) else ""
        if prev == "." or (depth > 0 and nxt == "="):
            continue
        edits.append((t.start[0], t.start[1], t.string, mapping[t.string]))
    if not edits:
        return None
    lines = code.split("\n")
    for row, col, old, new in sorted(edits, reverse=True):
        ln = lines[row - 1]
        lines[row - 1] = ln[:col] + new + ln[col + len(old):]
    return textwrap.indent("\n".join(lines).rstrip("\n"), "    ")


def _used_params(f: dict) -> list[str]:
    names = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", f["body"]))
    return [p for p in f["params"] if p in names]


def _body_mc(held: list[dict], n_items: int, max_chars: int,
             rng: np.random.Generator) -> list[dict]:
    """Body multiple choice in groups of 4 short functions of similar body length.

    The 4 functions of a group share the same 4 choices (their bodies, shuffled per item),
    so a model that ignores the prompt gets exactly 1 of the 4 items right: chance is 1/4
    by construction, whatever the model prefers a priori.
    """
    short = sorted((f for f in held if len(f["body"]) <= max_chars),
                   key=lambda f: (len(f["body"]), f["body"]))
    items: list[dict] = []
    i = 0
    while len(items) < n_items and i + 4 <= len(short):
        grp = short[i:i + 4]
        bodies = [f["body"] for f in grp]
        if len(set(bodies)) < 4:  # equal bodies: slide by one
            i += 1
            continue
        i += 4
        for f in grp:
            choices = [bodies[int(k)] for k in rng.permutation(4)]
            items.append({"prompt": render_prompt([{"role": "user", "content": f["user"]}]),
                          "choices": choices, "label": choices.index(f["body"]),
                          "group": f["module"]})
    order = rng.permutation(len(items))
    return [items[int(k)] for k in order][:n_items]


def _args_variants(f: dict, name_pool: list[str], rng: np.random.Generator) -> list[str] | None:
    used = _used_params(f)
    if not used:
        return None
    taken = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", f["user"] + " " + f["body"]))
    cands = [n for n in name_pool if n not in taken]
    variants: list[str] = []
    for _ in range(30):
        new = [cands[int(j)] for j in rng.choice(len(cands), size=len(used), replace=False)]
        v = rename_params(f["body"], dict(zip(used, new)))
        if v is not None and v != f["body"] and v not in variants:
            variants.append(v)
        if len(variants) == 3:
            return variants
    return None


def _args_mc(held: list[dict], n_items: int, rng: np.random.Generator,
             names_from: list[dict] | None = None) -> list[dict]:
    """Items from `held` in order; the renamed parameters come from the parameter names of
    `names_from` (default: `held`)."""
    name_pool = sorted({p for f in (held if names_from is None else names_from)
                        for p in f["params"] if len(p) > 1})
    items = []
    for f in held:
        variants = _args_variants(f, name_pool, rng)
        if variants is None:
            continue
        label = int(rng.integers(0, 4))
        variants.insert(label, f["body"])
        items.append({"prompt": render_prompt([{"role": "user", "content": f["user"]}]),
                      "choices": variants, "label": label, "group": f["module"]})
        if len(items) == n_items:
            break
    return items


def _number(items: dict[str, list[dict]], ids=lambda task, j: f"{task}-{j:04d}"
            ) -> dict[str, list[dict]]:
    """Give each task's items their ids (first key), in order."""
    return {task: [{"id": ids(task, j), **{k: v for k, v in it.items() if k != "id"}}
                   for j, it in enumerate(its)] for task, its in items.items()}


def make_val_items(cfg: dict, seed: int, held: list[dict],
                   items: dict[str, list[dict]]) -> tuple[dict[str, list[dict]], dict]:
    """`val_per_task` validation items per task from the held-out functions that no test
    item uses (any test item of a function has its prompt and its true body: a validation
    item of the same function would be the test item), drawn by the test items' generators
    with the stream [seed, 202, VAL_STREAM]. Never a pool function (the pool is drawn from
    the other functions, without knowing these). pycode_body_mc takes its groups of 4 from
    the shortest such functions, longer than body_mc_max_chars once the short ones run out;
    pycode_args_mc takes those whose body uses a parameter. Either may get fewer items than
    asked. Returns (items, counts for the summary's extra)."""
    n = val_count({"val_per_task": DEFAULTS["val_per_task"], **cfg}, "pycode")
    if not n:
        return {}, {}
    rng = np.random.default_rng([seed, 202, VAL_STREAM])
    taken = {it["prompt"] for its in items.values() for it in its}
    free = [f for f in held
            if render_prompt([{"role": "user", "content": f["user"]}]) not in taken]
    body = _body_mc(free, n, int(cfg["max_body_chars"]), rng)
    args = _args_mc(free, n, rng, names_from=held)
    val = _number({"pycode_body_mc": body, "pycode_args_mc": args}, val_id)
    cap = int(cfg["body_mc_max_chars"])
    over = sum(len(it["choices"][it["label"]]) > cap for it in val["pycode_body_mc"])
    return val, {"val_free_functions": len(free), "val_body_mc_over_cap": over}


def build(cfg: dict, seed: int = 0, root: Path | None = None) -> Built:
    """Hold out benchmark functions first, then build the pool from the rest."""
    # Checks the snapshot first (an InputError if it was changed), then records it.
    source = ({"stdlib_snapshot": stdlib_snapshot.info()} if root is None
              else {"stdlib_folder": str(root)})
    rng = np.random.default_rng([seed, 202])
    funcs = functions(cfg, root)
    n_items = int(cfg["items_per_task"])
    perm = [funcs[int(i)] for i in rng.permutation(len(funcs))]
    # Hold out enough functions for both tasks: short ones for body_mc (+ slack for groups
    # with equal bodies), ones whose body uses a parameter for args_mc.
    short = np.cumsum([len(f["body"]) <= int(cfg["body_mc_max_chars"]) for f in perm])
    eligible = np.cumsum([bool(_used_params(f)) for f in perm])
    size = int(max(np.searchsorted(short, n_items + 12), np.searchsorted(eligible, n_items + 20))) + 1
    if size > len(perm) // 3:
        raise InputError(f"only {len(perm)} stdlib functions pass the caps; too few for "
                         f"{n_items} benchmark items per task", field="pycode.items_per_task")
    held, rest = perm[:size], perm[size:]
    items = {"pycode_body_mc": _body_mc(held, n_items, int(cfg["body_mc_max_chars"]), rng),
             "pycode_args_mc": _args_mc(held, n_items, rng)}
    for task, its in items.items():
        for j, it in enumerate(its):
            it["id"] = f"{task}-{j:04d}"
        items[task] = [{"id": it["id"], **{k: v for k, v in it.items() if k != "id"}}
                       for it in its]
        if len(its) < n_items:
            raise RuntimeError(f"{task}: only {len(its)} items could be built")
    # A body shared with a held-out function ("Variable.__init__(self, master, value, name)"
    # in StringVar/IntVar/...) would teach the benchmark answer under another name.
    held_bodies = {" ".join(words(f["body"])) for f in held}
    cands = [(make_record("", f["user"], f["body"], f"pycode/{f['file']}"), f["module"])
             for f in rest if " ".join(words(f["body"])) not in held_bodies]
    same_body = len(rest) - len(cands)
    chosen, dropped = select_pool(cands, items, cfg, int(cfg["n"]))
    dropped["same_body_as_held_out"] = same_body
    val, val_extra = make_val_items(cfg, seed, held, items)
    return built_pool("pycode", chosen, items, dropped,
                      extra={"functions": len(funcs), "held_out": size, **source, **val_extra},
                      min_examples=cfg["min_examples"], val_items=val)
