"""Open-domain QA: TriviaQA and NQ-open, 5-shot, normalised exact match against every alias.

Grading (both): the output stripped of surrounding whitespace is the prediction; it is correct when
its SQuAD normalisation (``scoring.normalize_answer``) equals that of any alias. An empty
prediction is never correct. Generation (both forms): at most 32 new tokens, stop at ``"\\n"``,
``"."`` or ``","`` (lm-evaluation-harness ``triviaqa``/``nq_open``).

Shots are the same for every item: the first ``num_fewshot`` pool items, in the order of
``sha256(f"{fewshot_seed}:{id}")``, whose answer (``aliases[0]``) is printable ASCII of one to five
words without ``.`` or ``,`` (DPR's first alias is sometimes an emoji or a list title, and a shot
answer must not contain a stop string).

TriviaQA (``triviaqa/test.jsonl``; shots from ``triviaqa/dev.jsonl``, DPR's dev split carved from
the unfiltered train set). ``?`` is appended to a question only when missing (the harness always
appends one). Raw form (``delimiter = "\\n\\n"``)::

    Question: {shot question}
    Answer: {shot answer}

    ... (5 shots)

    Question: {question}
    Answer:

Chat form: user ``Question: {q}`` / assistant ``{answer}`` per shot, then user ``Question: {q}``.
Dev pool: ``triviaqa/dev.jsonl`` (8,837 items) less the shots (the same for every item, so no dev
item is its own exemplar: 8,832 with 5 shots); without the file (older data): the hash split.

NQ-open (``nq_open/test.jsonl``). There is no train or dev file, so the shots come from the test
file itself and are removed from the items that are evaluated (3,605 of 3,610 with 5 shots).
Raw form (lm-evaluation-harness ``nq_open``: description ``"Answer these questions:\\n"``,
``delimiter = "\\n"``)::

    Answer these questions:
    Q: {shot question}?
    A: {shot answer}
    ... (5 shots)
    Q: {question}?
    A:

Chat form: user ``Answer these questions:\\nQ: {q}?`` / assistant ``{answer}``, later shots as
user ``Q: {q}?``; the item last.
"""

from __future__ import annotations

from tokenfuse.tasks.base import DevPool, Item, Task, pick_shots, read_jsonl
from tokenfuse.tasks.boolq import question_mark
from tokenfuse.tasks.scoring import match_any_alias


def short_answer(item: Item) -> bool:
    """A demonstration answer: printable ASCII, one to five words, none of the stop characters."""
    a = item["answer"]
    return a.isascii() and a.isprintable() and 0 < len(a.split()) <= 5 and not any(c in a for c in ".,")


class OpenQA(Task):
    num_fewshot = 5
    max_new_tokens = 32
    stop_raw = ("\n", ".", ",")
    stop_chat = ("\n", ".", ",")

    def shots(self, item: Item) -> list[Item]:
        return self._shots

    def exemplar_ids(self) -> set[str]:
        return {s["id"] for s in self._shots}

    def target(self, item: Item) -> str:
        return " " + item["answer"]

    def extract(self, item: Item, output: str) -> str | None:
        return output.strip()

    def is_correct(self, item: Item, answer: str) -> bool:
        return match_any_alias(answer, item.get("aliases") or [item["answer"]])


class TriviaQA(OpenQA):
    name = "triviaqa"
    dev_pool = DevPool(("triviaqa/dev.jsonl",), hash_split=False)

    def _load(self) -> list[Item]:
        items = read_jsonl(self.data_dir, "triviaqa/test.jsonl")
        pool = read_jsonl(self.data_dir, "triviaqa/dev.jsonl") if self.shots_n else []
        self._shots = pick_shots(pool, self.fewshot_seed, self.shots_n, keep=short_answer)
        return items

    def query(self, item: Item) -> str:
        return f"Question: {question_mark(item['question'])}\nAnswer:"

    def chat_query(self, item: Item) -> str:
        return f"Question: {question_mark(item['question'])}"


class NQOpen(OpenQA):
    name = "nq_open"
    delimiter = "\n"

    def _load(self) -> list[Item]:
        items = read_jsonl(self.data_dir, "nq_open/test.jsonl")
        self._shots = pick_shots(items, self.fewshot_seed, self.shots_n, keep=short_answer)
        taken = {id(s) for s in self._shots}
        return [it for it in items if id(it) not in taken]

    def description(self, item: Item) -> str:
        return "Answer these questions:\n"

    def query(self, item: Item) -> str:
        return f"Q: {question_mark(item['question'])}\nA:"

    def chat_query(self, item: Item) -> str:
        return f"Q: {question_mark(item['question'])}"
