"""ARC-Challenge and ARC-Easy: 0-shot, generated letter (``arc/{challenge,easy}_test.jsonl``).

Dev pool: ``arc/{challenge,easy}_dev.jsonl`` (the source's validation split: 299 and 570 items);
0-shot, so no dev item is anyone's exemplar. Without the dev file (older data): the hash split.

Templates, stops and the cloze form: ``multiple_choice.ZeroShotLetterTask``. Items have 3 to 5
options; the letters follow the option count.
"""

from __future__ import annotations

from tokenfuse.tasks.base import DevPool, Item, read_jsonl
from tokenfuse.tasks.multiple_choice import ZeroShotLetterTask


class ARCChallenge(ZeroShotLetterTask):
    name = "arc_challenge"
    file = "arc/challenge_test.jsonl"
    dev_pool = DevPool(("arc/challenge_dev.jsonl",), hash_split=False)

    def _load(self) -> list[Item]:
        return read_jsonl(self.data_dir, self.file)


class ARCEasy(ARCChallenge):
    name = "arc_easy"
    file = "arc/easy_test.jsonl"
    dev_pool = DevPool(("arc/easy_dev.jsonl",), hash_split=False)
