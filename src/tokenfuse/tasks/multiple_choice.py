"""Shared by the generated-letter multiple-choice tasks (ARC, PIQA, MMLU): grading and cloze data.

Grading: ``scoring.extract_letter`` over the item's options; correct when it equals the gold letter.
"""

from __future__ import annotations

from tokenfuse.tasks.base import ClozeItem, Item, Task, letters
from tokenfuse.tasks.scoring import extract_letter

LETTER_INSTRUCTION = "Answer with the letter of the correct option."


def options_block(item: Item) -> str:
    """``A. first\\nB. second...`` (one option per line)."""
    return "\n".join(f"{L}. {c}" for L, c in zip(letters(len(item["choices"])), item["choices"]))


def gold_index(item: Item) -> int:
    return letters(len(item["choices"])).index(item["answer"])


class LetterTask(Task):
    """A multiple-choice task answered by generating the option's letter."""

    multiple_choice = True
    max_new_tokens = 16

    def extract(self, item: Item, output: str) -> str | None:
        return extract_letter(output, item["choices"])

    def cloze_context(self, item: Item) -> str:
        return f"Question: {item['question']}\nAnswer:"

    def cloze(self, item: Item) -> ClozeItem:
        return ClozeItem(self.cloze_context(item), tuple(" " + c for c in item["choices"]), gold_index(item))


class ZeroShotLetterTask(LetterTask):
    """0-shot, one option per line (ARC, PIQA).

    Raw form::

        Question: {question}
        A. {choice 0}
        B. {choice 1}
        ...
        Answer:

    Chat form: one user message, the same text with the last line ``Answer:`` replaced by a blank
    line and ``Answer with the letter of the correct option.``

    Generation: at most 16 new tokens; stop at ``"\\n"`` (raw: the letter is the first line) or at
    ``"\\n\\n"``/``"Question:"`` (chat).
    Cloze form (lm-evaluation-harness ``arc_challenge``/``piqa``): context
    ``Question: {question}\\nAnswer:``, continuations ``" {choice}"``.
    """

    stop_raw = ("\n",)
    stop_chat = ("\n\n", "Question:")

    def query(self, item: Item) -> str:
        return f"Question: {item['question']}\n{options_block(item)}\nAnswer:"

    def chat_query(self, item: Item) -> str:
        return f"Question: {item['question']}\n{options_block(item)}\n\n{LETTER_INSTRUCTION}"
