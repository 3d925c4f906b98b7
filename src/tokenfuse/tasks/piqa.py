"""PIQA: 0-shot, generated letter (``piqa/validation.jsonl``; ``question`` is the goal).

Templates, stops and the cloze form: ``multiple_choice.ZeroShotLetterTask`` (two options, A/B;
the cloze continuations keep the solutions' trailing spaces as the source has them).
Dev pool: the hash split (about one item in ten, left out of the test items); 0-shot.
"""

from __future__ import annotations

from tokenfuse.tasks.base import Item, read_jsonl
from tokenfuse.tasks.multiple_choice import ZeroShotLetterTask


class PIQA(ZeroShotLetterTask):
    name = "piqa"

    def _load(self) -> list[Item]:
        return read_jsonl(self.data_dir, "piqa/validation.jsonl")
