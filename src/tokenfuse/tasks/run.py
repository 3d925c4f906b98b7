"""A task run with an ensemble: which prompt form each member gets, and "generate a batch, then grade".

Owns the two rules ``tokenfuse select`` and ``tokenfuse eval`` share:

* prompt form: a member gets the task's chat form when it has a chat template (``Member.has_chat_template``),
  the raw few-shot form otherwise (``prompt_form="auto"``; ``"chat"``/``"raw"`` force one). An
  ensemble whose members differ gets ``"mixed"`` (``Task.prompt(chat="mixed")``: each member the
  form it would get alone);
* ``generate_graded``: generation (greedy by default) for a batch of items, each output graded by the task.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenfuse.errors import TokenfuseError
from tokenfuse.tasks.base import MIXED, Item, Score, Task

PROMPT_FORMS = ("auto", "chat", "raw")


def uses_chat(member, prompt_form: str = "auto") -> bool:
    """Whether ``member`` gets the chat form: ``auto`` = it has a chat template."""
    if prompt_form not in PROMPT_FORMS:
        raise TokenfuseError(f"--prompt-form: expected one of {', '.join(PROMPT_FORMS)}, got {prompt_form!r}")
    if prompt_form != "auto":
        return prompt_form == "chat"
    return bool(member.has_chat_template)


def prompt_form(members: Sequence, form: str = "auto") -> bool | str:
    """The ``chat`` argument for an ensemble of ``members``: ``True`` (chat) if every member gets the
    chat form, ``False`` (raw) if none does, else ``"mixed"`` (each member its own form)."""
    flags = {uses_chat(m, form) for m in members}
    return MIXED if len(flags) > 1 else flags.pop()


@dataclass(frozen=True)
class Graded:
    """One item's generation and its grade."""

    item: Item
    generation: Any  # tokenfuse.engine.Generation
    score: Score

    @property
    def text(self) -> str:
        return self.generation.text


def generate_graded(ensemble, task: Task, items: Sequence[Item], *, chat: bool | str,
                    max_new_tokens: int | None = None, sampling=None) -> list[Graded]:
    """Generation for ``items`` in one ``ensemble.generate`` call (the task's prompts and stop strings
    in form ``chat``; ``max_new_tokens`` default: the task's), each output graded by the task.
    Greedy unless ``sampling`` (an ``engine.Sampling``, or one per item: an item may be given several
    times, each with its own seed) says otherwise."""
    from tokenfuse.engine import Sampling

    gens = ensemble.generate([task.prompt(it, chat=chat) for it in items],
                             max_new_tokens=max_new_tokens or task.max_new_tokens,
                             sampling=Sampling() if sampling is None else sampling,
                             stop=task.stop(chat=chat), chat=chat)
    return [Graded(it, g, task.score(it, g.text)) for it, g in zip(items, gens)]
