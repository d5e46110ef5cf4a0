"""`skills`: a generated pool of word-level, programming-flavoured skills.

Eleven skills over short lists of words (repeat, reverse, sort, take first/last k, join
with commas, dedupe, drop a word, count words, count occurrences, find a position), with
Zipf-skewed frequencies (rank r gets a share proportional to 1/r**zipf_s; the rarest skill
is <= 2% of the pool at the default exponent). The most frequent skill, repeat, is plain
copying: the primitive every other list skill builds on. Every list comes from ONE of five
topic vocabularies, drawn uniformly and independently of the skill, so topic words say
nothing about the skill. Each skill has three paraphrased instructions sharing vocabulary ("Return", "Give",
"the words", "the list").

Everything works on whole words (the prototype found that a tiny model only memorised
character-level operations; word-level operations over many distinct inputs generalise).
Vocabulary words are frequent in the corpus (stdlib source, Python docs), so each is one
BPE token: the model copies tokens, not pieces of words.

Answers start with one space (" pear fig apple", " 3"): a word right after the prompt's
final newline would otherwise be a different BPE token than the same word after a space in
the instruction. Generation answers in the benchmark files are stored stripped (the scorer
strips the output); multiple-choice choices keep the space, exactly like pool responses.

Held-out inputs: benchmark lists are drawn first; a pool list never has the same SET of
words as any benchmark list (so no exact duplicate is possible), and the generic overlap
check runs anyway.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from clusterft.modeling.prompt import render_prompt
from clusterft.pools import VAL_STREAM
from clusterft.pools import Built
from clusterft.pools import built_pool
from clusterft.pools import make_record
from clusterft.pools import select_pool
from clusterft.pools import val_count
from clusterft.pools import val_id
from clusterft.pools import zipf_counts

DEFAULTS: dict = {
    # Pool size (examples).
    "n": 3000,
    # Benchmark items per task.
    "items_per_task": 200,
    # Validation items per task (<task>.val.jsonl beside the test items), for the
    # target-aware baselines LESS and RDS+: drawn by the same generators after the test
    # items, from a random stream of their own and held-out inputs only (the test items and
    # the pool are the same with any value), and dropped when the decontamination check
    # finds them too close to a test item (counted in the summary's val_dropped); the
    # held-out side may run short (pycode). 0 disables them.
    "val_per_task": 16,
    # Zipf exponent of the skill frequencies (rank r ~ 1/r**s); 1.4 puts the rarest of the
    # eleven skills at 1.6% of the pool and the most frequent (repeat) at 46%.
    "zipf_s": 1.4,
    # Shortest and longest word list (count_words may go 2 longer, first/last_k 1 longer,
    # dedupe / drop_word / count_occurrences add copies). Short lists keep exact-match
    # answers within reach of a tiny model.
    "min_words": 2,
    "max_words": 5,
    # Longest list in skills_words items (exact-match word sequences): 3 keeps the answers
    # to 1-4 words, within reach of a tiny model; the other tasks use max_words.
    "bench_max_words": 3,
}

# What every pool response starts with (see the module docstring): a generation item's
# stored answer is stripped, so the response a model is trained (and scored) on is this
# prefix + the answer (clusterft.tasks.targets).
RESPONSE_PREFIX = " "

# Five programming-flavoured topics of 40 words. Every word is frequent in the corpus
# (stdlib source and Python docs), so a byte-level BPE trained on it keeps the word (with
# its leading space) as ONE token: then "word level" is "token level" for the model
# (tests/test_corpus.py checks this with a 2048-token BPE). Large topics matter: with few
# words per topic a tiny model settles for "emit likely words of the topic" instead of
# learning to copy from the input.
TOPICS: dict[str, tuple[str, ...]] = {
    "code": tuple("""class classes function functions method methods module package object
        objects instance instances variable variables attribute attributes parameter
        argument arguments keyword literal expression statement operator exception thread
        widget parser clause context definition implementation namespace syntax suite
        struct spec super func lib""".split()),
    "data": tuple("""dict dictionary tuple string strings integer bytes key keys value values
        item items entry field node root stack pair element sequence mapping range offset
        length index numbers data token charset character characters letter format pattern
        result results group limit
        level""".split()),
    "files": tuple("""file files filename path directory dir source output input header label
        line lines lineno block section link prefix mode size version text encoding locale
        log message msg frame event command option options master parent child target state
        time system type""".split()),
    "actions": tuple("""call called raise raised yield break continue import assert pass passed
        print check match start stop test run read open create created compile copy get add
        use used using access implement support exist found returned returns executed pick
        pack set""".split()),
    "traits": tuple("""true single multiple empty small upper lower left right back next current
        default global local normal special standard new old different available bound
        built capital defined given specified present associated future other base hand
        head body end case error errors""".split()),
}

# Skills in Zipf rank order (most frequent first) with three instruction paraphrases each.
TEMPLATES: dict[str, tuple[str, ...]] = {
    "repeat": ("Repeat the words: {w}",
               "Return the same words: {w}",
               "Give the list unchanged: {w}"),
    "reverse": ("Reverse the order of the words: {w}",
                "Return the words in reverse order: {w}",
                "Give the list backwards: {w}"),
    "count_words": ("How many words are in the list? {w}",
                    "Count the words: {w}",
                    "Return the number of words in the list: {w}"),
    "sort": ("Sort the words alphabetically: {w}",
             "Return the words in alphabetical order: {w}",
             "Give the list sorted from A to Z: {w}"),
    "first_k": ("Return the first {k} words: {w}",
                "Give the first {k} words of the list: {w}",
                "Keep only the first {k} words: {w}"),
    "count_occurrences": ("How many times does {x} appear in the list? {w}",
                          "Count the occurrences of {x}: {w}",
                          "Return the number of times {x} is in the list: {w}"),
    "join_commas": ("Join the words with commas: {w}",
                    "Return the words separated by commas: {w}",
                    "Give the list as comma separated words: {w}"),
    "dedupe": ("Remove the repeated words: {w}",
               "Return the words without duplicates: {w}",
               "Give the list with each word only once: {w}"),
    "last_k": ("Return the last {k} words: {w}",
               "Give the last {k} words of the list: {w}",
               "Keep only the last {k} words: {w}"),
    "position": ("At which position is {x} in the list? {w}",
                 "Return the position of {x} in the list: {w}",
                 "Give the place (counting from 1) of {x} in the list: {w}"),
    "drop_word": ("Remove the word {x} from the list: {w}",
                  "Return the words except {x}: {w}",
                  "Give the list without {x}: {w}"),
}
SKILLS: tuple[str, ...] = tuple(TEMPLATES)
WORD_SKILLS = ("repeat", "reverse", "sort", "first_k", "last_k", "join_commas", "dedupe", "drop_word")
NUMBER_SKILLS = ("count_words", "count_occurrences", "position")
TASK_SKILLS: dict[str, tuple[str, ...]] = {
    "skills_words": WORD_SKILLS,
    "skills_numbers": NUMBER_SKILLS,
    "skills_mc": SKILLS,
}


class Example(dict):
    """One generated input: skill, topic, word list, parameters, answer and its words."""


def _pick(rng: np.random.Generator, seq, size: int) -> list:
    return [seq[i] for i in rng.choice(len(seq), size=size, replace=False)]


def _insert_copies(rng: np.random.Generator, ws: list[str], x: str, copies: int) -> list[str]:
    out = list(ws)
    for _ in range(copies):
        out.insert(int(rng.integers(0, len(out) + 1)), x)
    return out


def generate(skill: str, topic: str, rng: np.random.Generator, cfg: dict,
             for_mc: bool = False) -> Example:
    """Draw one input for `skill` from `topic`'s vocabulary and compute its answer.

    Lists have min_words..max_words words (count_words up to 2 more, first/last_k 1 more,
    dedupe/drop_word/count_occurrences add copies). `for_mc` makes lists long enough for 3
    distinct wrong answers of the same shape.
    """
    vocab = TOPICS[topic]
    lo, hi = int(cfg["min_words"]), int(cfg["max_words"])

    def length(low: int, high: int) -> int:
        return int(rng.integers(max(lo, low), max(lo, low, high) + 1))

    k, x = None, None
    if skill in ("repeat", "reverse", "sort", "join_commas"):
        ws = _pick(rng, vocab, length(3 if for_mc else lo, hi))
        out = {"repeat": ws, "reverse": ws[::-1], "sort": sorted(ws), "join_commas": ws}[skill]
        ans = ", ".join(out) if skill == "join_commas" else " ".join(out)
    elif skill in ("first_k", "last_k"):
        k = int(rng.integers(1, min(3, hi - 1) + 1))
        ws = _pick(rng, vocab, length(k + (3 if for_mc else 1), hi + 1))
        out = ws[:k] if skill == "first_k" else ws[-k:]
        ans = " ".join(out)
    elif skill == "dedupe":
        uniq = _pick(rng, vocab, length(3 if for_mc else lo, hi - 1))
        ws = list(uniq)
        for _ in range(int(rng.integers(1, 3))):
            j = int(rng.integers(0, len(uniq)))
            pos = ws.index(uniq[j]) + 1
            ws.insert(int(rng.integers(pos, len(ws) + 1)), uniq[j])
        out = list(dict.fromkeys(ws))
        ans = " ".join(out)
    elif skill == "drop_word":
        others = _pick(rng, vocab, length(4 if for_mc else 3, hi))
        x = others.pop(int(rng.integers(0, len(others))))
        ws = _insert_copies(rng, others, x, int(rng.integers(1, 3)))
        out = others
        ans = " ".join(out)
    elif skill == "count_words":
        ws = _pick(rng, vocab, length(lo, hi + 2))
        out, ans = None, str(len(ws))
    elif skill == "count_occurrences":
        c = int(rng.integers(1, 4))
        others = _pick(rng, vocab, length(lo, hi))
        x = others.pop()
        ws = _insert_copies(rng, others, x, c)
        out, ans = None, str(c)
    elif skill == "position":
        ws = _pick(rng, vocab, length(lo, hi))
        j = int(rng.integers(0, len(ws)))
        x = ws[j]
        out, ans = None, str(j + 1)
    else:
        raise KeyError(skill)
    tpl = TEMPLATES[skill][int(rng.integers(0, len(TEMPLATES[skill])))]
    user = tpl.format(w=" ".join(ws), k=k, x=x)
    return Example(skill=skill, topic=topic, words=ws, k=k, x=x, out=out, answer=ans,
                   user=user)


def _distractors(ex: Example, rng: np.random.Generator, n: int = 3) -> list[str]:
    """n wrong answers of the same shape as the correct one (same words or nearby numbers)."""
    skill, ws, ans = ex["skill"], ex["words"], ex["answer"]
    sep = ", " if skill == "join_commas" else " "
    options: set[str] = set()
    if skill in NUMBER_SKILLS:
        c = int(ans)
        pool = [v for v in range(max(1, c - 3), c + 4) if v != c]
        return [str(v) for v in _pick(rng, pool, n)]
    if skill in ("first_k", "last_k"):
        k = ex["k"]
        for i in range(len(ws) - k + 1):
            options.add(" ".join(ws[i:i + k]))
    elif skill == "drop_word":
        uniq = list(dict.fromkeys(ws))
        for y in uniq:
            if y != ex["x"]:
                options.add(" ".join(w for w in ws if w != y))
    else:
        out = ex["out"]
        for _ in range(200):
            perm = [out[i] for i in rng.permutation(len(out))]
            options.add(sep.join(perm))
            if len(options) > 3 * n:
                break
    options.discard(ans)
    opts = sorted(options)
    if len(opts) < n:
        raise ValueError(f"not enough distractors for {skill}: {ex['user']}")
    return _pick(rng, opts, n)


def _item(task: str, i: int, ex: Example, rng: np.random.Generator, mc: bool) -> dict:
    prompt = render_prompt([{"role": "user", "content": ex["user"]}])
    item = {"id": f"{task}-{i:04d}", "prompt": prompt}
    if mc:
        choices = [" " + d for d in _distractors(ex, rng)]
        label = int(rng.integers(0, len(choices) + 1))
        choices.insert(label, " " + ex["answer"])
        item.update(choices=choices, label=label)
    else:
        item["answer"] = ex["answer"]
    item["group"] = ex["skill"]
    return item


def _task_items(task: str, cfg: dict, rng: np.random.Generator, n: int, used: set,
                ids=lambda task, j: f"{task}-{j:04d}") -> list[dict]:
    """n items of one task, balanced over its skills, each from a word set not in `used`
    (which it extends)."""
    topics = sorted(TOPICS)
    skills = TASK_SKILLS[task]
    tcfg = dict(cfg)
    if task == "skills_words":
        tcfg["max_words"] = min(int(cfg["max_words"]), int(cfg["bench_max_words"]))
    out = []
    for i in range(n):
        skill = skills[i % len(skills)]
        while True:
            ex = generate(skill, topics[int(rng.integers(0, len(topics)))], rng, tcfg,
                          for_mc=task == "skills_mc")
            key = frozenset(ex["words"])
            if key not in used:
                used.add(key)
                break
        out.append(ex)
    order = rng.permutation(len(out))
    return [{**_item(task, j, out[int(o)], rng, mc=task == "skills_mc"), "id": ids(task, j)}
            for j, o in enumerate(order)]


def make_items(cfg: dict, rng: np.random.Generator) -> tuple[dict[str, list[dict]], set]:
    """Benchmark items of the three skills tasks, balanced over each task's skills.

    Returns the items and the set of word SETS used (held out from the pool). Inputs are
    unique across all items of all tasks (by word set).
    """
    used: set[frozenset] = set()
    items = {task: _task_items(task, cfg, rng, int(cfg["items_per_task"]), used)
             for task in TASK_SKILLS}
    return items, used


def make_val_items(cfg: dict, seed: int, held_out: set) -> dict[str, list[dict]]:
    """`val_per_task` validation items per task, drawn like the test items from the stream
    [seed, 101, VAL_STREAM] (the test items' and the pool's stream is untouched), each from
    a word set that no test item (`held_out`) and no other validation item uses. Their
    word sets are not held out from the pool (it is drawn without knowing them)."""
    n = val_count({"val_per_task": DEFAULTS["val_per_task"], **cfg}, "skills")
    if not n:
        return {}
    rng = np.random.default_rng([seed, 101, VAL_STREAM])
    used = set(held_out)
    return {task: _task_items(task, cfg, rng, n, used, ids=val_id) for task in TASK_SKILLS}


def build(cfg: dict, seed: int = 0) -> Built:
    """Draw the benchmark items first, then the pool (Zipf counts per skill)."""
    rng = np.random.default_rng([seed, 101])
    items, held_out = make_items(cfg, rng)
    counts = zipf_counts(int(cfg["n"]), len(SKILLS), float(cfg["zipf_s"]))
    topics = sorted(TOPICS)
    cands: list[tuple[dict, str]] = []
    dropped = Counter()
    for skill, c in zip(SKILLS, counts):
        made = 0
        while made < int(c * 1.3) + 10:
            ex = generate(skill, topics[int(rng.integers(0, len(topics)))], rng, cfg)
            if frozenset(ex["words"]) in held_out:
                dropped["held_out_input"] += 1
                continue
            cands.append((make_record("", ex["user"], RESPONSE_PREFIX + ex["answer"], "skills"),
                          skill))
            made += 1
    quota = dict(zip(SKILLS, counts))
    chosen, reasons = select_pool(cands, items, cfg, quota)
    dropped.update(reasons)
    have = Counter(lab for _, lab in chosen)
    short = {s: k - have[s] for s, k in quota.items() if have[s] < k}
    if short:
        raise RuntimeError(f"skills: not enough clean candidates for {short}")
    order = rng.permutation(len(chosen))
    chosen = [chosen[int(i)] for i in order]
    return built_pool("skills", chosen, items, dropped,
                      extra={"skill_counts": dict(zip(SKILLS, counts))},
                      val_items=make_val_items(cfg, seed, held_out))

