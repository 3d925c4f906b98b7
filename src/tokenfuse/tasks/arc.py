"""ARC-Challenge and ARC-Easy: 0-shot, generated letter (``arc/{challenge,easy}_test.jsonl``; dev
items for choosing configurations from ``arc/{challenge,easy}_dev.jsonl``).

Templates, stops and the cloze form: ``multiple_choice.ZeroShotLetterTask``. Items have 3 to 5
options; the letters follow the option count.
"""

from __future__ import annotations

from tokenfuse.tasks.base import Item, read_jsonl
from tokenfuse.tasks.multiple_choice import ZeroShotLetterTask


class ARCChallenge(ZeroShotLetterTask):
    name = "arc_challenge"
    file = "arc/challenge_test.jsonl"
    dev_file = "arc/challenge_dev.jsonl"

    def _load(self) -> list[Item]:
        return read_jsonl(self.data_dir, self.file)


class ARCEasy(ARCChallenge):
    name = "arc_easy"
    file = "arc/easy_test.jsonl"
    dev_file = "arc/easy_dev.jsonl"
