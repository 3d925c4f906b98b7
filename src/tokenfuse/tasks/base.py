"""What every task shares: the data directory, JSONL loading, the seeded subset and prompt assembly.

A task is bound to its data when it is built (``load_task``): the items to evaluate and the
few-shot pool are read once. Everything after that is pure: ``prompt(item, chat=...)`` builds the
prompt, ``score(item, output)`` extracts the answer and grades it, ``cloze(item)`` (multiple choice
only) gives the likelihood form. ``tokenfuse select`` and ``tokenfuse eval`` call the same methods.

Prompt assembly, the same for every task (lm-evaluation-harness's ``fewshot_context``):

* raw form (base members)::

      description + query(shot_1) + target(shot_1) + delimiter + ... + query(item)

  with a delimiter after the last shot, i.e. ``description + delimiter.join(query(s) + target(s)
  for s in shots) + delimiter + query(item)``; without shots simply ``description + query(item)``.
* chat form (members with a chat template; one message list, each member renders it with its own
  template): the shots as alternating turns, the description at the start of the first user turn
  (lm-evaluation-harness's ``--apply_chat_template --fewshot_as_multiturn``)::

      [user: description + chat_query(shot_1), assistant: chat_target(shot_1), ...,
       user: chat_query(item)]

Each task module documents its ``description``, ``query``, ``target`` and their chat variants.

Dev items (``dev_items``, for choosing a configuration — ``tokenfuse select`` and ``eval``'s ``auto``
row — never for reporting) come from the task's **dev pool**, declared once per task as
``dev_pool`` (a ``DevPool``): the benchmark's own dev or train files (``files``: ARC's
``*_dev.jsonl``, GSM8K's ``train.jsonl``, TriviaQA's and MMLU's ``dev.jsonl``), less any item that is
a few-shot exemplar of every item (``exemplar_ids``), and/or the hash split of the evaluated items
(``hash_split``): an item whose ``sha256(f"dev:{id}")`` is 0 modulo ``DEV_SHARE`` (10, i.e. about one
item in ten). The hash-split share is left out of ``items`` whenever it is a dev item, so test
items never include one (``hold_out``; GSM8K keeps its share out although its pool is the train
file, so its test items stay what they were). A task whose dev file is missing from the data
directory (older data) falls back to the hash split, with a line on standard error saying so.

Subsets: ``subset(limit, seed)`` ranks every item by ``sha256(f"{seed}:{item['id']}")`` and keeps
the ``limit`` first, returned in file order. The choice depends only on the seed and the ids (not on
the Python version or the file order), the same items for every model and method, and a smaller
limit gives a subset of a larger one.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from tokenfuse.errors import TokenfuseError

DATA_ENV = "TOKENFUSE_DATA"
DEFAULT_SEED = 1234  # lm-evaluation-harness's default few-shot seed

Item = dict[str, Any]
Message = dict[str, str]


class TaskDataError(TokenfuseError):
    """Benchmark data is missing or malformed; the message names the file and the fix."""


@dataclass(frozen=True)
class Score:
    """One graded output: the answer extracted from it (``None``: nothing usable) and whether it is right."""

    correct: bool
    extracted: str | None


@dataclass(frozen=True)
class ClozeItem:
    """The likelihood form of a multiple-choice item: score ``context + continuations[i]`` for each i.

    The word-boundary space belongs to the continuation (``" yes"``), as in lm-evaluation-harness.
    ``gold`` is the index of the correct continuation.
    """

    context: str
    continuations: tuple[str, ...]
    gold: int


def resolve_data_dir(data_dir: str | os.PathLike | None = None) -> Path:
    """The benchmark directory: ``data_dir`` if given, else ``$TOKENFUSE_DATA``, else an error."""
    if data_dir:
        root = Path(data_dir).expanduser()
    elif os.environ.get(DATA_ENV):
        root = Path(os.environ[DATA_ENV]).expanduser()
    else:
        raise TaskDataError(f"no benchmark data directory: pass --data DIR or set {DATA_ENV}=DIR "
                            "(a directory in the layout <benchmark>/<split>.jsonl)")
    if not root.is_dir():
        raise TaskDataError(f"{root}: benchmark data directory not found; pass --data DIR or set {DATA_ENV}=DIR")
    return root


def read_jsonl(root: Path, relative: str) -> list[Item]:
    """Read ``root/relative`` (one JSON object per line); a missing file names itself and the fix."""
    path = root / relative
    if not path.is_file():
        raise TaskDataError(f"{path}: benchmark file not found; the data directory must hold {relative} "
                            f"(pass --data DIR or set {DATA_ENV}=DIR)")
    items = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                items.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise TaskDataError(f"{path}:{n}: not valid JSON: {err.msg}") from None
    return items


DEV_SHARE = 10  # the hash split: about one item in DEV_SHARE is a dev item


def is_dev(item: Item) -> bool:
    """Whether ``item`` falls in the hash split's dev share (``sha256(f"dev:{id}")`` is 0 modulo ``DEV_SHARE``)."""
    return int(hashlib.sha256(f"dev:{item['id']}".encode()).hexdigest(), 16) % DEV_SHARE == 0


@dataclass(frozen=True)
class DevPool:
    """Where a task's dev items come from (``Task.dev_pool``; the module docstring).

    Attributes:
        files: the benchmark's own dev (or train) files, relative to the data directory; their items
            less the exemplars (``Task.exemplar_ids``) are dev items.
        hash_split: the hash-split share of the evaluated items is a dev item too.
        hold_out: the hash-split share is left out of the evaluated items (always, when ``hash_split``).
    """

    files: tuple[str, ...] = ()
    hash_split: bool = True
    hold_out: bool = False

    def describe(self) -> str:
        return " + ".join([*self.files] + (["the hash split of the test file"] if self.hash_split else []))


HASH_SPLIT = DevPool()  # the default pool: the hash split alone


def rank_key(seed: int, item_id: str) -> str:
    return hashlib.sha256(f"{seed}:{item_id}".encode()).hexdigest()


def seeded_order(items: Sequence[Item], seed: int) -> list[Item]:
    """The items in the seed's fixed pseudo-random order (ties, i.e. repeated ids, keep file order)."""
    return sorted(items, key=lambda it: rank_key(seed, str(it["id"])))


def subset(items: Sequence[Item], limit: int | None, seed: int = DEFAULT_SEED) -> list[Item]:
    """A fixed seeded subset of ``limit`` items, in file order (all items when ``limit`` is None)."""
    if limit is None or limit >= len(items):
        return list(items)
    if limit < 0:
        raise TaskDataError(f"--limit: expected a positive number, got {limit}")
    index = {id(it): i for i, it in enumerate(items)}
    chosen = seeded_order(items, seed)[:limit]
    return sorted(chosen, key=lambda it: index[id(it)])


def letters(n: int) -> str:
    return "ABCDEFGHIJKLMNOPQRSTUVWXYZ"[:n]


MIXED = "mixed"  # prompt form of an ensemble whose members differ in having a chat template


class Task:
    """One benchmark: its items, prompts, generation limits and grading.

    Subclasses set the class attributes and implement ``_load``, ``query``, ``target`` and
    ``extract`` (and ``is_correct`` where equality is not the test); the chat variants default to
    the raw ones.
    """

    name: ClassVar[str]
    num_fewshot: ClassVar[int] = 0  # default shots
    delimiter: ClassVar[str] = "\n\n"  # between shots, and between the last shot and the item
    max_new_tokens: ClassVar[int] = 32
    stop_raw: ClassVar[tuple[str, ...]] = ()
    stop_chat: ClassVar[tuple[str, ...]] = ()
    multiple_choice: ClassVar[bool] = False
    dev_pool: ClassVar[DevPool] = HASH_SPLIT  # where the dev items come from (the module docstring)

    def __init__(self, data_dir: str | os.PathLike | None = None, *, num_fewshot: int | None = None,
                 fewshot_seed: int = DEFAULT_SEED) -> None:
        self.data_dir = resolve_data_dir(data_dir)
        self.shots_n = self.num_fewshot if num_fewshot is None else num_fewshot
        if self.shots_n < 0:
            raise TaskDataError(f"num_fewshot: expected 0 or more, got {self.shots_n}")
        self.fewshot_seed = fewshot_seed
        loaded = self._load()
        self.dev_source = self._resolve_dev_pool()
        share = [it for it in loaded if is_dev(it)] if self.pool.hash_split or self.pool.hold_out else []
        if share:  # the hash-split share never reaches the evaluated items
            loaded = [it for it in loaded if not is_dev(it)]
        self._held: list[Item] = share if self.pool.hash_split else []
        self._dev_items: list[Item] | None = None  # read on first use
        self.items: list[Item] = loaded

    def _resolve_dev_pool(self) -> str:
        """Set ``self.pool`` (``dev_pool``, or the hash split when a dev file is missing, said on
        standard error) and return its description."""
        missing = [f for f in self.dev_pool.files if not (self.data_dir / f).is_file()]
        self.pool = self.dev_pool
        if not missing:
            taken = len(self.exemplar_ids()) if self.pool.files else 0
            return self.pool.describe() + (f" (less the {taken} shots taken from it)" if taken else "")
        self.pool = HASH_SPLIT
        note = f"the hash split of the test file (no {', '.join(missing)})"
        print(f"{self.name}: {', '.join(missing)} not found under {self.data_dir}: dev items fall back to "
              f"the hash split of the test file (about one item in {DEV_SHARE}, left out of the test items)",
              file=sys.stderr)
        return note

    # ------------------------------------------------------------------ data
    def _load(self) -> list[Item]:
        """Read the evaluation items (and any few-shot pool); return the items."""
        raise NotImplementedError

    def subset(self, limit: int | None, seed: int = DEFAULT_SEED) -> list[Item]:
        """The fixed seeded subset for ``--limit`` (see the module docstring)."""
        return subset(self.items, limit, seed)

    def dev_items(self) -> list[Item]:
        """The dev pool's items (see the module docstring); never in ``items``, never an exemplar of every item."""
        if self._dev_items is None:
            taken = self.exemplar_ids()
            files = [it for f in self.pool.files for it in read_jsonl(self.data_dir, f) if str(it["id"]) not in taken]
            self._dev_items = files + self._held
        return self._dev_items

    def exemplar_ids(self) -> set[str]:
        """Ids of the pool items that are every item's few-shot exemplars (left out of the dev pool)."""
        return set()

    def dev_subset(self, limit: int | None, seed: int = DEFAULT_SEED) -> list[Item]:
        """A fixed seeded subset of the dev items, as ``subset`` of the test items."""
        return subset(self.dev_items(), limit, seed)

    def shots(self, item: Item) -> list[Item]:
        """The few-shot examples for ``item`` (none by default)."""
        return []

    # ------------------------------------------------------------------ templates
    def description(self, item: Item) -> str:
        return ""

    def query(self, item: Item) -> str:
        raise NotImplementedError

    def target(self, item: Item) -> str:
        """A shot's answer as it follows ``query`` in the raw form (with its leading space)."""
        raise NotImplementedError

    def chat_query(self, item: Item) -> str:
        return self.query(item)

    def chat_target(self, item: Item) -> str:
        return self.target(item).strip()

    # ------------------------------------------------------------------ prompts
    def prompt(self, item: Item, *, chat: bool | str = False):
        """The prompt: raw text (``chat=False``), a chat message list (``chat=True``) or, for an
        ensemble of members with and without chat templates, both (``chat="mixed"``: a
        ``TwoFormPrompt``; each member gets the form it would get alone)."""
        if chat == MIXED:
            from tokenfuse.engine import TwoFormPrompt

            return TwoFormPrompt(self.chat_messages(item), self.raw_prompt(item))
        return self.chat_messages(item) if chat else self.raw_prompt(item)

    def raw_prompt(self, item: Item) -> str:
        shots = self.shots(item)
        body = "".join(self.query(s) + self.target(s) + self.delimiter for s in shots)
        return self.description(item) + body + self.query(item)

    def chat_messages(self, item: Item) -> list[Message]:
        messages: list[Message] = []
        for s in self.shots(item):
            messages.append({"role": "user", "content": self.chat_query(s)})
            messages.append({"role": "assistant", "content": self.chat_target(s)})
        messages.append({"role": "user", "content": self.chat_query(item)})
        messages[0] = {"role": "user", "content": self.description(item) + messages[0]["content"]}
        return messages

    def stop(self, *, chat: bool | str = False) -> list[str]:
        """Stop strings for generation (trimmed from the output by the engine). The mixed form
        stops on the chat form's strings plus the raw form's non-blank ones (a raw member's next
        few-shot question); blank raw stops such as ``"\n\n"`` would cut a chat member's answer."""
        if chat == MIXED:
            return list(dict.fromkeys([*self.stop_chat, *(s for s in self.stop_raw if s.strip())]))
        return list(self.stop_chat if chat else self.stop_raw)

    # ------------------------------------------------------------------ grading
    def extract(self, item: Item, output: str) -> str | None:
        """The answer in a generated ``output`` (``None`` when there is none)."""
        raise NotImplementedError

    def is_correct(self, item: Item, answer: str) -> bool:
        """Whether an extracted answer is right (default: equal to the item's ``answer``)."""
        return answer == item["answer"]

    def score(self, item: Item, output: str) -> Score:
        """Extract the answer from ``output`` and grade it; nothing extracted is wrong."""
        pred = self.extract(item, output)
        return Score(pred is not None and self.is_correct(item, pred), pred)

    def cloze(self, item: Item) -> ClozeItem:
        """The likelihood form of a multiple-choice item."""
        raise TaskDataError(f"task {self.name!r} has no likelihood (cloze) form: it is not multiple choice")


def pick_shots(pool: Sequence[Item], seed: int, n: int, *, keep=lambda item: True) -> list[Item]:
    """``n`` few-shot examples from ``pool``: the first ``n`` that ``keep`` accepts, in the seed's order."""
    return [it for it in seeded_order(pool, seed) if keep(it)][:n]
