"""The 8 benchmark tasks: registry, lookups and item checks.

Items are built by the pool modules (`clusterft.pools.<dataset>.build`) BEFORE their pool,
from held-out inputs, and written by `clusterft.stages.data.prepare.run_prepare_data` to
`<item_dir>/<task>.jsonl`; a task's validation items (for LESS / RDS+, `val_per_task`) go
beside them to `<item_dir>/<task>.val.jsonl` in the same format (`val_file`): whatever lists
an item folder's `*.jsonl` files as tasks skips those (`is_val_file`). Formats (see
docs/design.md):
- generate_until: {"id", "prompt", "answer", "group"}; exact match after strip;
- multiple_choice: {"id", "prompt", "choices", "label", "group"}; acc. Choices are the exact
  continuation of the prompt (which ends with "### Response:\\n"), written the way pool
  responses are written (skills responses start with a space, see pools/skills.py).
`group` is the item's true skill / module / chapter, for per-group breakdowns only.

`chance` is what guessing scores: 1/len(choices) for multiple choice; for generation, a
guesser that knows the answer format but not the content (see each description).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

from clusterft.pipeline.errors import InputError

DOMAINS = ("programming", "medicine")
OUTPUT_TYPES = ("multiple_choice", "generate_until")


@dataclass(frozen=True)
class TaskSpec:
    """One benchmark task."""

    name: str
    dataset: str
    domain: str
    output_type: str
    chance: float
    description: str

    @property
    def metric(self) -> str:
        return "acc" if self.output_type == "multiple_choice" else "exact_match"

    def to_dict(self) -> dict:
        return {**asdict(self), "metric": self.metric}


_TASKS = (
    TaskSpec("skills_words", "skills", "programming", "generate_until", 0.0,
             "Word-list skills (repeat, reverse, sort, first/last k, join with commas, "
             "dedupe, drop a word) on new word lists, balanced over the 8 skills; the answer "
             "is an exact word sequence. Chance ~0: a guesser that knows the format but not "
             "the skill must hit one ordering of a subset of 2-6 words (a few %); an untuned "
             "model does not answer with a bare word list at all."),
    TaskSpec("skills_numbers", "skills", "programming", "generate_until", 1 / 7,
             "Counting skills (number of words, occurrences of a word, position of a word) "
             "on new word lists, balanced over the 3 skills; the answer is an integer 1-7. "
             "Chance 1/7: guessing an integer in 1-7 uniformly (an untuned model that does "
             "not answer with a bare number scores ~0)."),
    TaskSpec("skills_mc", "skills", "programming", "multiple_choice", 0.25,
             "All 11 skills on new word lists, balanced; pick the right output among 4 of "
             "the same shape (other orders of the same words, other sub-lists, nearby "
             "numbers)."),
    TaskSpec("pycode_body_mc", "pycode", "programming", "multiple_choice", 0.25,
             "Held-out stdlib functions with short bodies: given the signature and "
             "docstring, pick the body among 4 bodies of similar length; items come in "
             "groups of 4 functions sharing the same choices, so a model that ignores the "
             "prompt scores exactly 1/4."),
    TaskSpec("pycode_args_mc", "pycode", "programming", "multiple_choice", 0.25,
             "Held-out stdlib functions: pick the true body among it and 3 copies whose "
             "parameter names were renamed to other functions' parameter names."),
    TaskSpec("icd10_chapter_mc", "icd10", "medicine", "multiple_choice", 0.25,
             "Held-out ICD-10 categories: pick the chapter title of a diagnosis among 4 "
             "chapter titles; balanced over chapters I-XXI."),
    TaskSpec("icd10_block_mc", "icd10", "medicine", "multiple_choice", 0.25,
             "Held-out ICD-10 categories: pick the block title of a diagnosis among 4 "
             "block titles (3 random other blocks); balanced over chapters I-XXI."),
    TaskSpec("cipher_words", "cipher", "programming", "generate_until", 0.0,
             "The testbed (pools/cipher.py): encode a held-out word tuple with one of the "
             "ciphers (a fixed permutation of a shared vocabulary named by its key), items "
             "uniform over the ciphers; exact match of every word. Chance ~0 (a guesser "
             "that knows the format picks one of n_words words per position)."),
    TaskSpec("icd10_code_chapter", "icd10", "medicine", "generate_until", 1 / 21,
             "Held-out ICD-10 codes: answer the chapter's Roman numeral; balanced over "
             "chapters I-XXI. Chance 1/21: guessing a numeral I-XXI uniformly (an untuned "
             "model scores ~0)."),
)
TASKS: dict[str, TaskSpec] = {t.name: t for t in _TASKS}


#: a task's validation items, beside its test items `<task>.jsonl`
VAL_SUFFIX = ".val.jsonl"


def val_file(item_dir: str | os.PathLike, task: str) -> Path:
    """`<item_dir>/<task>.val.jsonl`: the task's validation items."""
    return Path(item_dir) / f"{task}{VAL_SUFFIX}"


def is_val_file(path: str | os.PathLike) -> bool:
    """True for a validation-item file (`<task>.val.jsonl`): not a task's test items."""
    return Path(path).name.endswith(VAL_SUFFIX)


def tasks_for_dataset(dataset: str) -> list[str]:
    """Names of the tasks built from one dataset (source), in registry order."""
    return [t.name for t in _TASKS if t.dataset == dataset]


def tasks_for_domain(domain: str) -> list[str]:
    """Names of the tasks of one domain ('programming' or 'medicine'), in registry order."""
    if domain not in DOMAINS:
        raise InputError(f"unknown domain {domain!r}; known: {', '.join(DOMAINS)}",
                         field="domain")
    return [t.name for t in _TASKS if t.domain == domain]


def check_item(item: dict, spec: TaskSpec, where: str = "", line: int | None = None) -> None:
    """Raise InputError unless `item` has the fields of its task's output type."""
    def bad(field: str, what: str) -> InputError:
        return InputError(what, path=where or spec.name, line=line, field=field)

    for key in ("id", "prompt"):
        if not isinstance(item.get(key), str) or not item[key]:
            raise bad(key, "must be a non-empty string")
    if spec.output_type == "multiple_choice":
        ch = item.get("choices")
        if not isinstance(ch, list) or len(ch) < 2 or not all(isinstance(c, str) and c for c in ch):
            raise bad("choices", "must be a list of at least 2 non-empty strings")
        if len(set(ch)) != len(ch):
            raise bad("choices", "choices must be distinct")
        lab = item.get("label")
        if isinstance(lab, bool) or not isinstance(lab, int) or not 0 <= lab < len(ch):
            raise bad("label", "must be an index into choices")
    else:
        if not isinstance(item.get("answer"), str) or not item["answer"].strip():
            raise bad("answer", "must be a non-empty string")
        if item["answer"] != item["answer"].strip():
            raise bad("answer", "must be stripped (the scorer strips the model output)")
