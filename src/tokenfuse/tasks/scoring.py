"""Answer extraction and comparison, shared by the tasks. Pure functions on strings.

* ``last_number``: the last number in a text (GSM8K): ``-?`` digits with optional thousands commas
  and decimals; commas are dropped and a trailing ``.`` is not part of it. ``same_number`` compares
  numerically (``18``, ``18.0`` and ``18.00`` are the same).
* ``normalize_answer``: SQuAD v1.1 normalisation: lower case, drop ASCII punctuation, drop the
  articles ``a``/``an``/``the`` as words, collapse whitespace. ``match_any_alias`` is normalised
  exact match against every alias; an empty (after normalisation) prediction is never correct.
* ``extract_letter``: the chosen option letter in a generated answer, in this order of evidence:
  "answer is (X)" / "answer: X"; a letter opening the output (``B``, ``(B)``, ``B.``, ``B)``; not the
  article in "A car ..."); the first ``(X)``; the only option whose text occurs in the output; the
  first standalone valid capital letter (again not the article "A"). Only letters of existing
  options count.
* ``extract_yes_no``: the first ``yes``/``no``/``true``/``false`` word, as ``yes``/``no``.
* ``extract_bbh``: the text after the last "the answer is" (any case) up to the end of its line,
  stripped, one trailing ``.`` removed.
"""

from __future__ import annotations

import re
import string
from collections.abc import Sequence
from decimal import Decimal, InvalidOperation

_NUMBER = re.compile(r"-?\d(?:[\d,]*\d)?(?:\.\d+)?")
_PUNCT = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


# ---------------------------------------------------------------------------------------- numbers
def last_number(text: str) -> str | None:
    """The last number in ``text`` without thousands commas (``"1,200.50"`` -> ``"1200.50"``)."""
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def same_number(a: str | None, b: str | None) -> bool:
    """Numeric equality of two number strings; ``None`` or a non-number is never equal."""
    if a is None or b is None:
        return False
    try:
        return Decimal(a.replace(",", "")) == Decimal(b.replace(",", ""))
    except InvalidOperation:
        return False


# ---------------------------------------------------------------------------------------- QA
def normalize_answer(text: str) -> str:
    """SQuAD v1.1 answer normalisation."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def match_any_alias(prediction: str | None, aliases: Sequence[str]) -> bool:
    """Normalised exact match against any alias; an empty prediction is never correct."""
    if prediction is None:
        return False
    pred = normalize_answer(prediction)
    return bool(pred) and any(pred == normalize_answer(a) for a in aliases)


# ---------------------------------------------------------------------------------------- letters
_ANSWER_IS = re.compile(r"(?i:answer(?:\s+is)?)\s*:?\s*\(?([A-Z])\)?(?![A-Za-z])")
_OPENING = re.compile(r"\s*\(?([A-Z])(?:[).:,]|\s|$)")
_PAREN = re.compile(r"\(([A-Z])\)")
_STANDALONE = re.compile(r"(?<![A-Za-z'])([A-Z])(?![A-Za-z'])")


def _article(text: str, end: int) -> bool:
    """``text[end-1]`` is an ``A`` used as the article: followed by a space and a lower-case word."""
    return text[end - 1] == "A" and re.match(r" [a-z]", text[end:end + 2]) is not None


def extract_letter(output: str, choices: Sequence[str]) -> str | None:
    """The option letter chosen in ``output`` for options ``choices`` (see the module docstring)."""
    valid = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"[: len(choices)]
    for m in _ANSWER_IS.finditer(output):
        if m.group(1) in valid:
            return m.group(1)
    m = _OPENING.match(output)
    if m and m.group(1) in valid and not _article(output, m.end(1)):
        return m.group(1)
    for m in _PAREN.finditer(output):
        if m.group(1) in valid:
            return m.group(1)
    low = " ".join(output.lower().split())
    hits = [valid[i] for i, c in enumerate(choices) if (t := " ".join(c.lower().split())) and t in low]
    if len(hits) == 1:
        return hits[0]
    for m in _STANDALONE.finditer(output):
        if m.group(1) in valid and not _article(output, m.end(1)):
            return m.group(1)
    return None


# ---------------------------------------------------------------------------------------- yes / no
_YES_NO = re.compile(r"\b(yes|no|true|false)\b", re.IGNORECASE)


def extract_yes_no(output: str) -> str | None:
    m = _YES_NO.search(output)
    if m is None:
        return None
    return "yes" if m.group(1).lower() in ("yes", "true") else "no"


# ---------------------------------------------------------------------------------------- BBH
_BBH = re.compile(r"the answer is", re.IGNORECASE)


def extract_bbh(output: str) -> str | None:
    """The answer after the last "So the answer is" (``"(B)"`` from ``"... So the answer is (B)."``)."""
    ends = [m.end() for m in _BBH.finditer(output)]
    if not ends:
        return None
    answer = output[ends[-1]:].split("\n", 1)[0].strip()
    if answer.endswith("."):
        answer = answer[:-1].rstrip()
    return answer or None
