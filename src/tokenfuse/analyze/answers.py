"""``tokenfuse analyze answers``: which bytes of the gold answers the byte rows give less probability than
the best member, on the generate-form tasks whose items hold a gold answer text (GSM8K's solutions, TriviaQA's
and NQ-open's answers; BBH's test items hold only the answer, without the reasoning its prompts ask for).

Accuracy on a generative task says whether an answer came out right, not where the mixture went
astray. This scores each item's gold answer as generation would produce it: every member's byte model
starts after the member's own prompt ids (its chat or raw form, as ``tokenfuse eval`` gives it:
``tasks.run.prompt_form``) and reads the gold bytes (``engine.bytescore.member_byte_logprobs``, the byte
method's pruning); the byte rows mix them as in generation (``byte-mix``: the members' weights;
``byte-gate``, ``byte-online``: the fit, the shipped text fit for the bundled members; the mixer's state
starting after the prompt: ``engine.bytescore.mix_byte_logprobs``). Unlike generation, nothing is masked
(generation renormalises over the bytes that keep the output whole UTF-8, so each of its probabilities is
at least the one here: divided by one less the mass on the barred bytes) and the end is not scored.

The gold bytes: the task's chat-form target (``Task.chat_target``, no leading space) when any member
reads the chat form, else its raw target (``Task.target``). With members in both forms a raw member's
view of the first byte pays for the space it expected after ``Answer:``: the ``first`` column shows it.

Per task and row, over the items: natural-log loss per gold byte (``nats/B``) and by the byte's kind:
the first byte, digits, letters (ASCII), white space, other bytes, and the bytes of the item's answer
(its last occurrence in the gold text: GSM8K's number, the whole text of an open answer);
for each byte row against the best member (the member with the lowest ``nats/B`` on these items): the
share of gold bytes it gives less probability, and its paired per-item difference in ``nats/B`` with a
bootstrap 95 % interval (``stats.paired_bootstrap``; below zero: the row predicts the gold answers
better). ``--top`` lists the bytes where ``byte-gate`` (else the first byte row) loses most.

Usage: tokenfuse analyze answers --tasks gsm8k,triviaqa [--limit 50] [--seed 1234] [--dev] [--out DIR]
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tokenfuse.errors import ConfigError, TokenfuseError

BYTE_ROWS = ("byte-mix", "byte-gate", "byte-online")
KINDS = ("first", "digits", "letters", "space", "other", "answer")


def byte_kinds(gold: bytes, answer: str | None) -> dict[str, np.ndarray]:
    """``bool`` masks over ``gold``'s bytes, one per kind of ``KINDS`` (the module docstring)."""
    a = np.frombuffer(gold, dtype=np.uint8)
    digit = (a >= 0x30) & (a <= 0x39)
    letter = ((a >= 0x41) & (a <= 0x5A)) | ((a >= 0x61) & (a <= 0x7A))
    space = np.isin(a, list(b" \t\n\r"))
    first = np.zeros(a.size, dtype=bool)
    first[:1] = True
    ans = np.zeros(a.size, dtype=bool)
    at = gold.rfind(answer.encode("utf-8")) if answer else -1
    if at >= 0:
        ans[at:at + len(answer.encode("utf-8"))] = True
    return {"first": first, "digits": digit, "letters": letter, "space": space,
            "other": ~(digit | letter | space), "answer": ans}


@dataclass
class TaskBytes:
    """One task's gold bytes and every row's log-probability of each (items in order)."""

    golds: list[bytes] = field(default_factory=list)
    kinds: list[dict[str, np.ndarray]] = field(default_factory=list)
    rows: dict[str, list[np.ndarray]] = field(default_factory=dict)

    def add(self, gold: bytes, answer: str | None, rows: dict[str, np.ndarray]) -> None:
        self.golds.append(gold)
        self.kinds.append(byte_kinds(gold, answer))
        for name, lp in rows.items():
            self.rows.setdefault(name, []).append(np.asarray(lp, dtype=np.float64))

    def nats(self, row: str, kind: str | None = None) -> float:
        """The row's mean loss per gold byte (of ``kind``), over every item's bytes pooled."""
        lps = self.rows[row] if kind is None else [lp[k[kind]] for lp, k in zip(self.rows[row], self.kinds)]
        n = sum(lp.size for lp in lps)
        return -math.fsum(float(lp.sum()) for lp in lps) / n if n else math.nan

    def per_item(self, row: str) -> list[float]:
        return [-float(lp.mean()) if lp.size else math.nan for lp in self.rows[row]]

    def best_member(self, members: Sequence[str]) -> str:
        return min(members, key=self.nats)


def task_table(name: str, tb: TaskBytes, members: Sequence[str], gold_form: str, top: int = 0) -> list[str]:
    """The lines of one task's table (the module docstring)."""
    from tokenfuse.eval.stats import paired_bootstrap

    best = tb.best_member(members)
    n_bytes = sum(len(g) for g in tb.golds)
    out = [f"### {name}: {len(tb.golds)} items, {n_bytes:,} gold bytes ({gold_form}); best member {best}", "",
           "| row | nats/B | " + " | ".join(KINDS) + " | bytes below best | Δ nats/B vs best [95 %] |",
           "|---" * (len(KINDS) + 4) + "|"]
    for row in tb.rows:
        kinds = " | ".join(_num(tb.nats(row, k), 3) for k in KINDS)
        if row in members:
            vs = ("—", "—")
        else:
            below = sum(int((lp < b).sum()) for lp, b in zip(tb.rows[row], tb.rows[best]))
            d, lo, hi = paired_bootstrap(tb.per_item(row), tb.per_item(best))
            vs = (f"{100 * below / max(n_bytes, 1):.1f} %", f"{d:+.4f} [{lo:+.4f}, {hi:+.4f}]")
        out.append(f"| {row} | {_num(tb.nats(row), 4)} | {kinds} | {vs[0]} | {vs[1]} |")
    out.append("")
    shown = next((r for r in ("byte-gate", *BYTE_ROWS) if r in tb.rows), None)
    if top and shown:
        out += [f"Where {shown} loses most against {best} (nats; the gold text around the byte, the byte in [ ]):", "",
                "| item | byte | loss | context |", "|---|---|---|---|"]
        losses = [(float(b[j] - lp[j]), k, j) for k, (lp, b) in enumerate(zip(tb.rows[shown], tb.rows[best]))
                  for j in range(lp.size)]
        for loss, k, j in sorted(losses, reverse=True)[:top]:
            g = tb.golds[k]
            ctx = (g[max(0, j - 24):j].decode("utf-8", "replace") + "[" + g[j:j + 1].decode("utf-8", "replace") + "]"
                   + g[j + 1:j + 8].decode("utf-8", "replace"))
            out.append(f"| {k} | {g[j:j + 1]!r} | {loss:.2f} | `{_cell(ctx)}` |")
        out.append("")
    return out


def _num(x: float, digits: int) -> str:
    """A loss in the table; ``—`` where the items have no byte of that kind."""
    return "—" if math.isnan(x) else f"{x:.{digits}f}"


def _cell(text: str) -> str:
    return text.replace("\n", "\\n").replace("|", "\\|").replace("`", "'")


def gold_of(task, item: dict, chat: bool | str) -> tuple[str, str]:
    """The gold answer's text as the members would generate it, and which form it is (module docstring);
    a task whose items lack the text (BBH's test items hold the answer, not the reasoning before it) is
    refused, named."""
    try:
        if chat:
            return task.chat_target(item), "the chat form's target"
        return task.target(item), "the raw form's target"
    except KeyError as e:
        raise TokenfuseError(f"analyze answers: {task.name}'s items have no gold answer text to score (no {e} field: "
                             "only the answer); leave it out of --tasks") from None


def gold_rows(rows: dict, prompt, gold: str, *, chat: bool | str = False) -> dict[str, np.ndarray]:
    """The natural-log probability of each byte of ``gold`` after ``prompt`` under each member with a
    positive weight (by name) and each byte row of ``rows`` (name: its ``Ensemble``, the ``byte`` method;
    every row on the same members, weights and pruning): as generation starts, each member's byte model
    after its own ids of ``prompt`` (``chat`` as ``Ensemble.generate``'s), each row's mixer new after it."""
    from tokenfuse.engine.bytescore import live_members, member_byte_logprobs, mix_byte_logprobs
    from tokenfuse.engine.prompt import prompt_ids

    first = next(iter(rows.values()))
    members, pruning = first.members, first.combiner.params.pruning
    live = live_members(first.weights, first.combiner)
    lps = [member_byte_logprobs(members[i], first.decider.table(i), pruning, "", [gold],
                                start=prompt_ids(members[i], prompt, chat=chat))[0] for i in live]
    got = {members[i].name: lp for i, lp in zip(live, lps)}
    for name, ens in rows.items():
        got[name] = mix_byte_logprobs(ens.combiner, ens.weights, lps)
    return got


def answer_bytes(cfg, tasks: Sequence[str], *, limit: int = 50, seed: int | None = None, dev: bool = False,
                 data=None, top: int = 8, out: str | Path | None = None, progress: bool = True,
                 members=None, union=None) -> str:
    """The tables of the module docstring for each of ``tasks`` on ``limit`` items of the eval's seeded
    subset (``--dev``: of the dev items); with ``out``, ``answers.json`` (per task, row and kind: nats/B;
    per item: each row's summed log-probability and the gold's bytes) and ``answers.md`` there.
    ``members``/``union``: already loaded members of ``cfg`` (tests), as ``eval.runner.run_eval``'s. A byte
    row that cannot be built for these members (``byte-gate`` without a fit for them) is left out, said
    in the output."""
    from tokenfuse.combiners import REGISTRY
    from tokenfuse.engine.bytescore import live_members
    from tokenfuse.eval.batches import build_variant
    from tokenfuse.eval.methods import plan_methods
    from tokenfuse.load import ensemble_from_members, load_ensemble
    from tokenfuse.progress import progress_bar
    from tokenfuse.tasks import DEFAULT_SEED, load_task
    from tokenfuse.tasks.run import prompt_form

    if limit < 1:
        raise TokenfuseError(f"--limit: expected 1 or more items, got {limit}")
    loaded = [load_task(t, data) for t in tasks]
    mc = [t.name for t in loaded if t.multiple_choice]
    if mc:
        raise TokenfuseError(f"analyze answers: {', '.join(mc)} run in the likelihood form; read them with "
                             "`tokenfuse analyze options RUN` (this reads the generate-form tasks' gold answers)")
    base = load_ensemble(cfg, progress=progress) if members is None else ensemble_from_members(cfg, members, union=union)
    names = [m.name for m in base.members]
    specs = plan_methods(cfg, list(BYTE_ROWS), form="generate", registered=list(REGISTRY), log=lambda _: None)
    rows, lines = {}, []
    for spec in (s for s in specs if s.name in BYTE_ROWS):
        try:
            rows[spec.name] = build_variant(cfg, base, spec)
        except ConfigError as e:
            lines.append(f"{spec.name}: left out ({e})")
    if not rows:
        raise TokenfuseError("analyze answers: no byte row can be built for these members" +
                             (f": {'; '.join(lines)}" if lines else " (the byte method is not registered)"))
    lines += [""] if lines else []
    any_row = next(iter(rows.values()))
    live = live_members(any_row.weights, any_row.combiner)
    chat = prompt_form(base.members)
    seed = DEFAULT_SEED if seed is None else seed
    dump = {"members": names, "limit": limit, "seed": seed, "dev": dev, "tasks": {}}
    for task in loaded:
        items = (task.dev_subset if dev else task.subset)(limit, seed)
        tb, form = TaskBytes(), ""
        for item in progress_bar(items, desc=f"{task.name} gold answers", enabled=progress):
            gold, form = gold_of(task, item, chat)
            got = gold_rows(rows, task.prompt(item, chat=chat), gold, chat=chat)
            tb.add(gold.encode("utf-8"), str(item.get("answer")) if item.get("answer") is not None else None, got)
        if not tb.golds:
            raise TokenfuseError(f"analyze answers: {task.name} has no {'dev' if dev else 'test'} items")
        lines += task_table(task.name, tb, [names[i] for i in live], form, top=top)
        dump["tasks"][task.name] = {
            "gold": form, "best_member": tb.best_member([names[i] for i in live]),
            "nats_per_byte": {r: {k: None if math.isnan(x) else x for k, x in
                                  (("all", tb.nats(r)), *((k, tb.nats(r, k)) for k in KINDS))} for r in tb.rows},
            "items": [{"id": str(it["id"]), "bytes": len(g), **{r: float(tb.rows[r][k].sum()) for r in tb.rows}}
                      for k, (it, g) in enumerate(zip(items, tb.golds))]}
    text = "\n".join(lines)
    if out is not None:
        outp = Path(out)
        outp.mkdir(parents=True, exist_ok=True)
        (outp / "answers.md").write_text(text + "\n", encoding="utf-8")
        (outp / "answers.json").write_text(json.dumps(dump, indent=1) + "\n", encoding="utf-8")
    return text
