"""MMLU: 5-shot with the subject's dev examples, generated letter.

As lm-evaluation-harness ``mmlu_flan_n_shot_generative`` (the GaC paper's setting): the shots are
the subject's dev items in file order (``first_n``), options inline. One deviation: the harness's
``doc_to_text`` ends in ``"A: "`` and its targets are joined with another space (``"A:  (B)"``);
here the query ends in ``"A:"`` and the target is ``" (B)"``, so no prompt ends in a space.

Raw form (``{subject}`` with ``_`` read as spaces; ``delimiter = "\\n\\n"``)::

    The following are multiple choice questions (with answers) about {subject}.

    Q: {shot question, stripped}
    (A) {choice 0} (B) {choice 1} (C) {choice 2} (D) {choice 3}
    A: (B)

    ... (5 shots)

    Q: {question, stripped}
    (A) {choice 0} (B) {choice 1} (C) {choice 2} (D) {choice 3}
    A:

Chat form: the description then ``Q: ...\\n(A) ... (D) ...`` as the first user turn, assistant
``(B)``; the later turns without the description; the item last.

Generation: at most 16 new tokens; stop at ``"\\n"`` (raw: the answer is the first line) or
``"\\n\\n"`` (chat).
Grading: ``scoring.extract_letter``.

Cloze form (lm-evaluation-harness ``mmlu_continuation``): context
``The following are questions (with answers) about {subject}.\\n\\n`` + the shots as
``Question: {q}\\nAnswer: {gold option text}`` joined by ``"\\n\\n"`` + ``"\\n\\n"`` +
``Question: {question}\\nAnswer:``; continuations ``" {choice}"``.

Dev pool: ``mmlu/dev.jsonl`` (285 items, 5 per subject) plus the hash split of the test file (about
one item in ten, left out of the test items, as before the dev file joined the pool: 1,707 in all).
The dev file's items are also the shots, so a dev-file item's shots are its subject's *other* dev
items (the first ``num_fewshot`` of them: 4 with 5 shots, as a subject has 5); every other item,
test or dev, gets the subject's first ``num_fewshot`` dev items as before. No dev item is its own
exemplar. Without the dev file (then ``--num-fewshot 0``): the hash split alone.
"""

from __future__ import annotations

from collections import defaultdict

from tokenfuse.tasks.base import ClozeItem, DevPool, Item, TaskDataError, letters, read_jsonl
from tokenfuse.tasks.multiple_choice import LetterTask, gold_index


def subject_name(item: Item) -> str:
    return item["subject"].replace("_", " ")


class MMLU(LetterTask):
    name = "mmlu"
    num_fewshot = 5
    stop_raw = ("\n",)
    stop_chat = ("\n\n",)
    dev_pool = DevPool(("mmlu/dev.jsonl",), hash_split=True)

    def _load(self) -> list[Item]:
        items = read_jsonl(self.data_dir, "mmlu/test.jsonl")
        self._dev: dict[str, list[Item]] = defaultdict(list)
        if self.shots_n:
            for it in read_jsonl(self.data_dir, "mmlu/dev.jsonl"):
                self._dev[it["subject"]].append(it)
            missing = sorted({it["subject"] for it in items} - set(self._dev))
            if missing:
                raise TaskDataError(f"{self.data_dir / 'mmlu/dev.jsonl'}: no dev examples for subject(s) "
                                    f"{', '.join(missing[:5])}")
        return items

    def shots(self, item: Item) -> list[Item]:
        """The subject's first ``shots_n`` dev items, never the item itself (a dev-file item in the dev pool)."""
        return [s for s in self._dev[item["subject"]] if s["id"] != item["id"]][: self.shots_n]

    def description(self, item: Item) -> str:
        return f"The following are multiple choice questions (with answers) about {subject_name(item)}.\n\n"

    def chat_query(self, item: Item) -> str:
        opts = " ".join(f"({L}) {c}" for L, c in zip(letters(len(item["choices"])), item["choices"]))
        return f"Q: {item['question'].strip()}\n{opts}"

    def query(self, item: Item) -> str:
        return self.chat_query(item) + "\nA:"

    def target(self, item: Item) -> str:
        return f" ({item['answer']})"

    def cloze(self, item: Item) -> ClozeItem:
        shots = "".join(f"Question: {s['question'].strip()}\nAnswer: {s['choices'][gold_index(s)]}\n\n"
                        for s in self.shots(item))
        context = (f"The following are questions (with answers) about {subject_name(item)}.\n\n{shots}"
                   f"Question: {item['question'].strip()}\nAnswer:")
        return ClozeItem(context, tuple(" " + c for c in item["choices"]), gold_index(item))
