"""Prompts: plain text, chat messages, or both forms at once; each member encodes them its own way."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenfuse.members.base import Member


@dataclass(frozen=True)
class TwoFormPrompt:
    """One prompt in two forms: ``messages`` for members with a chat template (each renders them
    with its own template) and ``raw`` text for members without one (base models), instead of
    the plain ``"User: …\n\nAssistant:"`` rendering those would otherwise get."""

    messages: Sequence[dict]
    raw: str


Prompt = str | Sequence[dict] | TwoFormPrompt


def prompt_ids(member: Member, prompt: Prompt, *, chat: bool = False) -> list[int]:
    """``member``'s ids for ``prompt`` (``Member.ids_for_prompt``): text as is (or, with ``chat``, as one
    user message), messages through the member's own chat template (a member without one gets a
    ``TwoFormPrompt``'s raw form, else the plain rendering)."""
    text, raw = _forms(prompt)
    return member.ids_for_prompt(text, chat=chat, raw=raw)


def prompt_token_count(member: Member, prompt: Prompt, *, chat: bool = False) -> int:
    """How many ids ``member`` has for ``prompt`` (``Member.prompt_token_count``; ``prompt_ids``'s length)."""
    text, raw = _forms(prompt)
    return member.prompt_token_count(text, chat=chat, raw=raw)


def _forms(prompt: Prompt) -> tuple[str | Sequence[dict], str | None]:
    """What a member encodes for ``prompt``: its text or messages, and a ``TwoFormPrompt``'s raw form."""
    return (prompt.messages, prompt.raw) if isinstance(prompt, TwoFormPrompt) else (prompt, None)


def is_single(prompts) -> bool:
    """One prompt (text, a two-form prompt or one conversation) rather than a batch of them."""
    if isinstance(prompts, (str, TwoFormPrompt)):
        return True
    return bool(prompts) and isinstance(prompts[0], dict)
