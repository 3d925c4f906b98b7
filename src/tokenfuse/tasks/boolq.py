"""BoolQ: 0-shot, generated yes/no (``boolq/dev.jsonl``).

The questions in this copy already end in ``?``; one is added only when missing (the harness adds
one unconditionally).

Raw form (lm-evaluation-harness ``boolq``)::

    {passage}
    Question: {question}
    Answer:

Chat form: one user message, ``{passage}\\nQuestion: {question}\\n\\nAnswer yes or no.``

Generation: at most 8 new tokens; stop at ``"\\n"`` (raw) or ``"\\n\\n"``/``"Question:"`` (chat).
Grading: the first ``yes``/``no``/``true``/``false`` word of the output (``scoring.extract_yes_no``)
equals the gold.
Cloze form: the raw prompt as context, continuations ``(" no", " yes")`` (the source's order).
Dev pool: the hash split (about one item in ten, left out of the test items); 0-shot.
"""

from __future__ import annotations

from tokenfuse.tasks.base import ClozeItem, Item, Task, read_jsonl
from tokenfuse.tasks.scoring import extract_yes_no


def question_mark(text: str) -> str:
    text = text.strip()
    return text if text.endswith("?") else text + "?"


class BoolQ(Task):
    name = "boolq"
    multiple_choice = True
    max_new_tokens = 8
    stop_raw = ("\n",)
    stop_chat = ("\n\n", "Question:")

    def _load(self) -> list[Item]:
        return read_jsonl(self.data_dir, "boolq/dev.jsonl")

    def query(self, item: Item) -> str:
        return f"{item['passage']}\nQuestion: {question_mark(item['question'])}\nAnswer:"

    def target(self, item: Item) -> str:
        return " " + item["answer"]

    def chat_query(self, item: Item) -> str:
        return f"{item['passage']}\nQuestion: {question_mark(item['question'])}\n\nAnswer yes or no."

    def extract(self, item: Item, output: str) -> str | None:
        return extract_yes_no(output)

    def cloze(self, item: Item) -> ClozeItem:
        return ClozeItem(self.query(item), (" no", " yes"), 1 if item["answer"] == "yes" else 0)
