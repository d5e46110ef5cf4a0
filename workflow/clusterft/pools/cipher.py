"""`cipher`: the testbed pool, a positive control for data selection (docs/testbed.md).

Each skill is a *cipher*: a fixed random permutation of ONE shared set of single-token words,
applied word by word ("Encode with cipher upper: key node" -> " stack pair"). Why this shape:

- **a known skill a small model learns and then saturates**: a cipher is a finite mapping
  (n_words facts), so once every word's image is learnt, more examples of that skill add
  nothing: the redundant-data regime the paper's premise needs;
- **told apart only by what they do**: every skill uses the same vocabulary and the same
  instruction template; only the key word differs. Clustering by the words of the input has
  no shortcut beyond the key; the gradient of an example is about the mapping it teaches;
- **Zipf-skewed frequencies** (rank r ~ 1/r**zipf_s) over tables larger than a rare
  cipher's examples show: a random 31% leaves the rare ciphers' tables partly unseen (an item
  with an unseen word cannot be answered, whatever the steps), while a skill-balanced 31%
  (the oracle) shows nearly all of what full data shows. The testbed runs on a base model
  that has practised other ciphers (PRACTICE_KEYS; clusterft.stages.models.practice), so
  fine-tuning learns tables, not the lookup they share: what then decides the score is data;
- **uniform, held-out evaluation**: `items_per_skill` items per cipher, each on a word
  tuple that the pool never holds (under any key), so an item is answered by applying the
  mapping, not by recalling a pool example.

Answers start with one space (like `skills`): the answer's first word is then the same BPE
token as the word after a space in the instruction. Stored benchmark answers are stripped.

The words and keys are frequent words of the general corpus (taken from `skills`' topic
vocabularies, which tests/test_corpus.py checks are single BPE tokens).
"""

from __future__ import annotations

from collections import Counter
from itertools import product

import numpy as np

from clusterft.modeling.prompt import render_prompt
from clusterft.pipeline.errors import InputError
from clusterft.pools import VAL_STREAM
from clusterft.pools import Built
from clusterft.pools import built_pool
from clusterft.pools import make_record
from clusterft.pools import select_pool
from clusterft.pools import val_count
from clusterft.pools import val_id
from clusterft.pools import zipf_counts
from clusterft.pools.skills import TOPICS

DEFAULTS: dict = {
    # The testbed's frozen shape (docs/testbed.md, fourth pilot: fixed from runs of full,
    # random and oracle only, before the method ran on it; config/config.yaml repeats it).
    # Pool size (examples).
    "n": 600,
    # Number of ciphers (skills); at most len(KEYS), and 8 on a model that practised
    # ciphers (the other keys are the practice ciphers').
    "n_skills": 8,
    # Size of the shared vocabulary every cipher permutes; at most len(WORDS).
    "n_words": 12,
    # Words per example, drawn with repetition (input and answer have this many words).
    "words_per_example": 3,
    # Zipf exponent of the cipher frequencies (rank r ~ 1/r**s).
    "zipf_s": 1.5,
    # Benchmark items per cipher (the task has n_skills x items_per_skill items).
    "items_per_skill": 50,
    # Word tuples held out of the pool (the items' inputs are drawn from these, and the
    # validation items' from the rest of them); at least items_per_skill + val_per_task.
    "held_out": 80,
    # Validation items per task (for LESS / RDS+), from held-out tuples no test item of the
    # same cipher uses. 0 disables them.
    "val_per_task": 16,
    # Not used (items_per_skill decides); accepted so that the shared
    # `tasks.items_per_task` setting does not have to be special-cased.
    "items_per_task": None,
}

RESPONSE_PREFIX = " "
TASK = "cipher_words"
TEMPLATE = "Encode with cipher {key}: {w}"

# The shared vocabulary (permuted by every cipher) and the keys (one per cipher): disjoint,
# single-token words of the corpus.
WORDS: tuple[str, ...] = tuple("""dict tuple string integer bytes key value item entry field
    node root stack pair element sequence mapping range offset index token format pattern
    group""".split())
KEYS: tuple[str, ...] = tuple("""upper lower left right back next current default global
    local normal special single multiple empty small""".split())
# The practice ciphers' keys (`models.<name>.practice`: a base model that has met ciphers
# before, so that fine-tuning teaches the testbed's tables, not the lookup itself): the last
# eight keys, with permutations from their own random stream. A testbed on a practised model
# uses the first eight (the config check keeps n_skills <= 8 there).
PRACTICE_KEYS: tuple[str, ...] = KEYS[8:]
STREAM, PRACTICE_STREAM = 131, 137


def skill_names(cfg: dict, keys: tuple[str, ...] = KEYS) -> tuple[str, ...]:
    """The ciphers' names (their keys), in Zipf rank order (most frequent first)."""
    return keys[: int(cfg["n_skills"])]


def check(cfg: dict, prefix: str = "cipher") -> None:
    """InputError naming ``<prefix>.<key>`` for settings the generator cannot meet, before
    any work (the config check calls it with prefix ``datasets.<name>``)."""
    cfg = {**DEFAULTS, **cfg}
    k, w, L = int(cfg["n_skills"]), int(cfg["n_words"]), int(cfg["words_per_example"])
    if not 2 <= k <= len(KEYS):
        raise InputError(f"must be 2..{len(KEYS)} (one key word per cipher), got {k}",
                         field=f"{prefix}.n_skills")
    if not 2 <= w <= len(WORDS) or L < 1:
        raise InputError(f"n_words must be 2..{len(WORDS)} and words_per_example >= 1, got "
                         f"{w} and {L}", field=f"{prefix}.n_words")
    n_tuples = w ** L
    need = int(cfg["items_per_skill"]) + int(cfg.get("val_per_task") or 0)
    if not need <= int(cfg["held_out"]) < n_tuples:
        raise InputError(f"must be at least items_per_skill + val_per_task ({need}) and below "
                         f"the {n_tuples} word tuples, got {cfg['held_out']}",
                         field=f"{prefix}.held_out")
    top = max(zipf_counts(int(cfg["n"]), k, float(cfg["zipf_s"])))
    if top > n_tuples - int(cfg["held_out"]):
        raise InputError(f"the most frequent cipher needs {top} distinct inputs but only "
                         f"{n_tuples - int(cfg['held_out'])} word tuples are left for the pool: "
                         "lower n or zipf_s, or raise n_words or words_per_example",
                         field=f"{prefix}.n")


def mappings(cfg: dict, rng: np.random.Generator,
             keys: tuple[str, ...] = KEYS) -> dict[str, dict[str, str]]:
    """One random permutation of the vocabulary per cipher (drawn first, from the pool's
    stream, so the mapping depends on the seed only)."""
    vocab = WORDS[: int(cfg["n_words"])]
    return {key: dict(zip(vocab, (vocab[i] for i in rng.permutation(len(vocab)))))
            for key in skill_names(cfg, keys)}


def encode(mapping: dict[str, str], ws: tuple[str, ...]) -> str:
    return " ".join(mapping[w] for w in ws)


def user_text(key: str, ws: tuple[str, ...]) -> str:
    return TEMPLATE.format(key=key, w=" ".join(ws))


def _item(i: int, key: str, ws: tuple[str, ...], mapping: dict[str, str], ids) -> dict:
    return {"id": ids(TASK, i), "prompt": render_prompt([{"role": "user",
                                                          "content": user_text(key, ws)}]),
            "answer": encode(mapping, ws), "group": key}


def build(cfg: dict, seed: int = 0, practice: bool = False) -> Built:
    """Mappings, held-out tuples and items first; then the pool (Zipf counts per cipher,
    inputs uniform over the tuples the items never use). ``practice``: the practice
    ciphers (PRACTICE_KEYS, their own random stream) instead of the testbed's."""
    cfg = {**DEFAULTS, **cfg}
    check(cfg)
    rng = np.random.default_rng([seed, PRACTICE_STREAM if practice else STREAM])
    maps = mappings(cfg, rng, PRACTICE_KEYS if practice else KEYS)
    keys = skill_names(cfg, PRACTICE_KEYS if practice else KEYS)
    vocab = WORDS[: int(cfg["n_words"])]
    tuples = list(product(vocab, repeat=int(cfg["words_per_example"])))
    order = rng.permutation(len(tuples))
    held = [tuples[int(i)] for i in order[: int(cfg["held_out"])]]
    free = [tuples[int(i)] for i in order[int(cfg["held_out"]):]]
    n_items = int(cfg["items_per_skill"])
    test_pairs: list[tuple[str, tuple[str, ...]]] = []
    for key in keys:
        pick = rng.choice(len(held), size=n_items, replace=False)
        test_pairs += [(key, held[int(j)]) for j in pick]
    test_order = rng.permutation(len(test_pairs))
    items = {TASK: [_item(j, *test_pairs[int(o)], maps[test_pairs[int(o)][0]],
                          ids=lambda t, i: f"{t}-{i:04d}")
                    for j, o in enumerate(test_order)]}
    counts = zipf_counts(int(cfg["n"]), len(keys), float(cfg["zipf_s"]))
    cands = []
    for key, c in zip(keys, counts):
        # distinct tuples per cipher (the pool check drops repeats anyway)
        for j in rng.choice(len(free), size=min(len(free), int(c * 1.2) + 10), replace=False):
            ws = free[int(j)]
            cands.append((make_record("", user_text(key, ws),
                                      RESPONSE_PREFIX + encode(maps[key], ws), "cipher"), key))
    quota = dict(zip(keys, counts))
    chosen, reasons = select_pool(cands, items, cfg, quota)
    have = Counter(lab for _, lab in chosen)
    short = {s: k - have[s] for s, k in quota.items() if have[s] < k}
    if short:
        raise RuntimeError(f"cipher: not enough clean candidates for {short}")
    chosen = [chosen[int(i)] for i in rng.permutation(len(chosen))]
    used = {(k, ws) for k, ws in test_pairs}
    return built_pool("cipher", chosen, items, Counter(reasons),
                      extra={"skill_counts": dict(zip(keys, counts)),
                             "mappings": maps, "held_out_tuples": len(held)},
                      val_items=make_val_items(cfg, seed, maps, held, used))


def make_val_items(cfg: dict, seed: int, maps: dict, held: list, used: set) -> dict:
    """`val_per_task` validation items, uniform over the ciphers, on held-out tuples that no
    test item of the same cipher uses (their own random stream: the test items and the pool
    are the same with any value)."""
    n = val_count({"val_per_task": DEFAULTS["val_per_task"], **cfg}, "cipher")
    if not n:
        return {}
    rng = np.random.default_rng([seed, STREAM, VAL_STREAM])
    keys = tuple(maps)  # the testbed's or the practice ciphers', in rank order
    out = []
    for j in range(n):
        key = keys[j % len(keys)]
        left = [ws for ws in held if (key, ws) not in used]
        ws = left[int(rng.integers(0, len(left)))]
        used.add((key, ws))
        out.append(_item(j, key, ws, maps[key], ids=val_id))
    return {TASK: out}
