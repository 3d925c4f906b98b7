"""GSM8K: few-shot chain of thought, answer = the last number in the output.

As lm-evaluation-harness ``gsm8k`` (the GaC paper's setting): 5 shots from the train split, each
with its full original solution (calculator annotations ``<<48/2=24>>`` and the final ``#### 72``
line kept, as the harness keeps them). The shots are the same for every item: the first
``num_fewshot`` train items in the order of ``sha256(f"{fewshot_seed}:{id}")``.

Raw form (``delimiter = "\\n\\n"``)::

    Question: {shot question}
    Answer: {shot solution}

    ... (5 shots)

    Question: {question}
    Answer:

Chat form: user ``Question: {shot question}`` / assistant ``{shot solution}`` per shot, then user
``Question: {question}``.

Generation: at most 256 new tokens; stop at ``"\\n\\n"`` or ``"Question:"`` (raw), ``"Question:"``
(chat: instruct models write blank lines inside an answer). Scoring: the last number in the output
(``scoring.last_number``) equals the gold number numerically; an output without a number is wrong.

Dev pool: ``gsm8k/train.jsonl`` (7,473 items) less the shots (the same for every item, so no dev
item is its own exemplar: 7,468 with 5 shots). The hash-split share of the test file (about one in
ten) stays out of the test items, as before the train file was the pool, so the test items are
unchanged; it is not a dev item either. Without the train file (older data; then ``--num-fewshot 0``):
the hash split of the test file.
"""

from __future__ import annotations

from tokenfuse.tasks.base import DevPool, Item, Task, pick_shots, read_jsonl
from tokenfuse.tasks.scoring import last_number, same_number


class GSM8K(Task):
    name = "gsm8k"
    num_fewshot = 5
    max_new_tokens = 256
    stop_raw = ("\n\n", "Question:")
    stop_chat = ("Question:",)
    dev_pool = DevPool(("gsm8k/train.jsonl",), hash_split=False, hold_out=True)

    def _load(self) -> list[Item]:
        items = read_jsonl(self.data_dir, "gsm8k/test.jsonl")
        if self.shots_n:
            train = read_jsonl(self.data_dir, "gsm8k/train.jsonl")
            self._shots = pick_shots(train, self.fewshot_seed, self.shots_n)
        else:
            self._shots = []
        return items

    def shots(self, item: Item) -> list[Item]:
        return self._shots

    def exemplar_ids(self) -> set[str]:
        return {s["id"] for s in self._shots}

    def query(self, item: Item) -> str:
        return f"Question: {item['question']}\nAnswer:"

    def target(self, item: Item) -> str:
        return " " + item["solution"]

    def chat_query(self, item: Item) -> str:
        return f"Question: {item['question']}"

    def extract(self, item: Item, output: str) -> str | None:
        return last_number(output)

    def is_correct(self, item: Item, answer: str) -> bool:
        return same_number(answer, item["answer"])
