"""BIG-Bench Hard: 3-shot chain of thought from ``bbh/cot_prompts.jsonl``, exact match.

As lm-evaluation-harness ``bbh_cot_fewshot`` (GaC's ``bbh_fewshot``, 3 shots). Each task's official
prompt is split into its description and three exemplars (at ``"\\n\\nQ: "``; an exemplar's query
ends at ``"A: Let's think step by step."``), so the raw form reproduces the official prompt
byte for byte and appends the item::

    {official 3-shot CoT prompt of the item's task}

    Q: {question}
    A: Let's think step by step.

Chat form: user ``{description}\\n\\nQ: {exemplar question}`` / assistant
``Let's think step by step.\\n{exemplar reasoning} So the answer is X.`` per exemplar (later user
turns without the description), then user ``Q: {question}``.

Generation: at most 256 new tokens (the harness allows 1024; the exemplars' chains are far
shorter); stop at ``"\\n\\n"`` or ``"\\nQ:"`` (raw), ``"\\n\\nQ:"`` (chat). Grading: the text after
the last "the answer is" up to the end of its line, without a trailing period
(``scoring.extract_bbh``), must equal the target exactly (``(B)``, ``True``, ``} ] >``...).

Dev pool: the hash split of ``bbh/test.jsonl`` (about one item in ten, left out of the test items);
the exemplars are the official prompts', never items of the file.
"""

from __future__ import annotations

from tokenfuse.tasks.base import Item, Task, TaskDataError, read_jsonl
from tokenfuse.tasks.scoring import extract_bbh

COT = "A: Let's think step by step."


def split_cot_prompt(prompt: str, *, origin: str = "cot prompt") -> tuple[str, list[tuple[str, str]]]:
    """``(description, [(question, reasoning), ...])`` of an official BBH CoT prompt.

    ``question`` is the exemplar's input (after ``Q: ``); ``reasoning`` follows ``COT`` (it starts
    with a newline). Joining them back as ``description + "\\n\\n" + "\\n\\n".join(f"Q: {q}\\n{COT}{r}")``
    gives the prompt again.
    """
    description, *parts = prompt.split("\n\nQ: ")
    shots = []
    for part in parts:
        q, sep, reasoning = part.partition("\n" + COT)
        if not sep:
            raise TaskDataError(f"{origin}: an exemplar lacks {COT!r}")
        shots.append((q, reasoning))
    return description, shots


class BBH(Task):
    name = "bbh"
    num_fewshot = 3
    max_new_tokens = 256
    stop_raw = ("\n\n", "\nQ:")
    stop_chat = ("\n\nQ:",)

    def _load(self) -> list[Item]:
        items = read_jsonl(self.data_dir, "bbh/test.jsonl")
        path = self.data_dir / "bbh/cot_prompts.jsonl"
        self._prompts: dict[str, tuple[str, list[Item]]] = {}
        for row in read_jsonl(self.data_dir, "bbh/cot_prompts.jsonl"):
            description, pairs = split_cot_prompt(row["prompt"], origin=f"{path} ({row['task']})")
            shots = [{"id": f"{row['task']}-shot-{i}", "question": q, "reasoning": r}
                     for i, (q, r) in enumerate(pairs)]
            self._prompts[row["task"]] = (description + "\n\n", shots)
        missing = sorted({it["task"] for it in items} - set(self._prompts))
        if missing:
            raise TaskDataError(f"{path}: no CoT prompt for task(s) {', '.join(missing)}")
        return items

    def shots(self, item: Item) -> list[Item]:
        return self._prompts[item["task"]][1][: self.shots_n]

    def description(self, item: Item) -> str:
        return self._prompts[item["task"]][0]

    def query(self, item: Item) -> str:
        return f"Q: {item['question']}\n{COT}"

    def target(self, item: Item) -> str:
        return item["reasoning"]

    def chat_query(self, item: Item) -> str:
        return f"Q: {item['question']}"

    def chat_target(self, item: Item) -> str:
        return COT.removeprefix("A: ") + item["reasoning"]

    def extract(self, item: Item, output: str) -> str | None:
        return extract_bbh(output)
