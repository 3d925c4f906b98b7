"""``tokenfuse eval``'s ``auto`` row: per task, a configuration chosen on dev items only.

For each task the runner first runs, on the task's dev items (``Task.dev_items``: its dev pool, the
benchmark's own dev or train file and/or the hash split the test items never touch), every row of
the table and the candidates below; then ``choose`` picks one by its dev accuracy alone; the
``auto`` row on the test items is that configuration's records there. Nothing about the test items
enters the choice.

Candidates (``candidates``), besides the table's own rows (each member alone, every ensemble row
asked in ``--methods``, whatever its method, vote / MBR / sequence average, ``mux`` and every
``sc:<member>``, their samples drawn on the dev items too):

* ``auto:gated@T`` — GaC gated by the best member on dev (the one far ahead, if any) at each threshold
  ``T`` of ``THRESHOLDS``: the gate's piece where it is confident, the ensemble elsewhere; the best
  member is also the primary;
* ``auto:gac@kept`` / ``auto:unite@kept`` — UniTE's selection rule on the dev accuracies
  (``tokenfuse.select.select_members``: members more than 10 points behind the best are dropped,
  weight 0), the best member primary; only when it keeps two members or more.

The chosen configuration is also written as a config (``chosen_config``, ``auto/<task>.yaml`` under
``--out``) that ``tokenfuse generate --config`` runs — not for ``vote``/``mbr``/``seq-avg``/``mux``/``sc``,
which are not one ensemble.

Choice (``choose``): the best member on dev (ties: member order) unless the best other candidate
(ties: candidate order) beats it on dev with its paired bootstrap ``LEVEL`` interval (1,000
resamples, seed 0) wholly above 0 — so ``auto`` ends with one member alone unless an ensemble is
measurably better on dev.

Dev counts (``dev_counts``): every row and candidate runs on ``DEV_LIMITS[form]`` dev items — 500 in
the likelihood form, 200 in the generate form — and the members alone, which decide the best member
(and so the gate, the primary and the kept members of the candidates), on at least
``MEMBER_DEV_LIMITS[form]`` (the same 500 / 200), the first dev items of the same seeded order, so
the candidates' items are among them. ``--dev-limit`` and ``--member-dev-limit`` override the
defaults; the members never rank on fewer items than the rest. (Without ``auto`` in the run, the
members' ranking that only picks a task's primary member runs on as many dev items as the run has
test items for the task, at most those counts: ``primary_dev_count``.) A task whose dev pool is smaller
runs on all of it, and the choice says so (``dev_note``: in ``results.json``, ``results.md`` and the
header of ``auto/<task>.yaml``). A member alone is the cheapest row, and picking the wrong one is
what puts ``auto`` below the best member: 50 generate-form dev items could not tell the members
apart on a task mixing many subtasks (BBH). The challenger's gain is paired on the candidates' items.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenfuse.eval.methods import MethodSpec
from tokenfuse.eval.stats import paired_bootstrap

THRESHOLDS = (0.3, 0.5, 0.7, 0.9)
LEVEL = 0.90
DEV_LIMITS = {"likelihood": 500, "generate": 200}  # every row and candidate, per task (``--dev-limit``)
MEMBER_DEV_LIMITS = {"likelihood": 500, "generate": 200}  # the members alone, at least (``--member-dev-limit``)


def dev_counts(form: str, dev_limit: int | None = None, member_dev_limit: int | None = None) -> tuple[int, int]:
    """The dev items asked for in ``form``: ``(every row and candidate, the members alone)``. An
    explicit ``--dev-limit`` / ``--member-dev-limit`` wins over the form's default; the members never
    get fewer than the rest. A smaller dev pool gives all of its items (``dev_note`` says so)."""
    n = dev_limit or DEV_LIMITS[form]
    return n, max(n, member_dev_limit or MEMBER_DEV_LIMITS[form])


def primary_dev_count(form: str, test_items: int, *, with_auto: bool, dev_limit: int | None = None,
                      member_dev_limit: int | None = None) -> int:
    """The dev items the members alone are ranked on to choose a task's primary member
    (``runner.task_primary``): with ``auto`` in the run, ``auto``'s own member count (``dev_counts``;
    its records then serve both); without it ``--member-dev-limit`` if given, else as many as the
    task's ``test_items`` (at least 1, at most ``MEMBER_DEV_LIMITS[form]``): a choice that only sets
    the primary costs no more than the run it serves."""
    if with_auto:
        return dev_counts(form, dev_limit, member_dev_limit)[1]
    return member_dev_limit or max(1, min(test_items, MEMBER_DEV_LIMITS[form]))


def dev_note(asked: int, member_asked: int, *, used: int, member_used: int, pool: int, source: str) -> str | None:
    """Why fewer dev items were used than asked (``None`` when every count was met)."""
    if used >= asked and member_used >= member_asked:
        return None
    short = [f"{u} of {a} {who}" for u, a, who in ((used, asked, "for every row and candidate"),
                                                   (member_used, member_asked, "for the members alone")) if u < a]
    return f"dev items {', '.join(short)}: the dev pool ({source}) has {pool}"


@dataclass(frozen=True)
class Choice:
    """What ``auto`` chose for one task, and why.

    Attributes:
        chosen: the candidate's row name.
        best_single: the best member alone on dev.
        challenger: the best other candidate on dev (``None`` without one).
        gain: challenger minus best single on dev (accuracy, 0..1) and its ``LEVEL`` interval.
        dev_acc: every candidate's dev accuracy (a member alone's on its ``member_n`` items).
        n: dev items of every row and candidate (the gain is paired on them).
        member_n: dev items the members alone were ranked on.
    """

    chosen: str
    best_single: str
    challenger: str | None
    gain: tuple[float, float, float] | None
    dev_acc: dict[str, float]
    n: int
    member_n: int

    def as_dict(self) -> dict:
        return {"chosen": self.chosen, "best_single": self.best_single, "challenger": self.challenger,
                "dev_gain": None if self.gain is None else {"gain": self.gain[0], "ci": list(self.gain[1:]),
                                                            "level": LEVEL},
                "dev_acc": self.dev_acc, "dev_items": self.n, "member_dev_items": self.member_n}


def accuracy(records: Sequence[dict]) -> float:
    """The share of ``records`` marked correct (0 for none)."""
    return sum(bool(r["correct"]) for r in records) / max(len(records), 1)


def best_single(dev: dict[str, Sequence[dict]]) -> str:
    """The ``single:`` row with the highest dev accuracy (the first of equal ones)."""
    singles = [m for m in dev if m.startswith("single:")]
    return max(singles, key=lambda m: accuracy(dev[m]))


def candidates(cfg, dev: dict[str, Sequence[dict]]) -> list[MethodSpec]:
    """The dev-driven candidates (module docstring) from the singles' dev records ``dev``."""
    from tokenfuse.select import CandidateResult, select_members

    names = [m.name for m in cfg.members]
    if len(names) < 2:
        return []
    best = best_single(dev).split(":", 1)[1]
    specs = [MethodSpec(f"auto:gated@{t:g}", "engine", tuple(names),
                        {"method": "gac", "gate": best, "threshold": t, "primary": best, "params": {}})
             for t in THRESHOLDS]
    measured = [CandidateResult(n, accuracy(dev[f"single:{n}"]), 0.0, len(dev[f"single:{n}"])) for n in names]
    kept = {d.name for d in select_members(measured, max_members=len(names)) if d.taken}
    if len(kept) >= 2:
        weights = {n: (mc.weight if n in kept else 0.0) for n, mc in zip(names, cfg.members)}
        for method in ("gac", "unite"):
            specs.append(MethodSpec(f"auto:{method}@kept", "engine", tuple(n for n in names if n in kept),
                                    {"method": method, "gate": None, "threshold": None, "primary": best,
                                     "weights": weights, "params": {}}))
    return specs


def choose(dev: dict[str, Sequence[dict]], ranked: dict[str, Sequence[dict]] | None = None) -> Choice:
    """The choice rule (module docstring) over every candidate's dev records ``dev`` (paired by
    item), the members ranked on their records ``ranked`` (default: theirs in ``dev``)."""
    from tokenfuse.eval.summary import paired_correct

    ranked = ranked or {m: r for m, r in dev.items() if m.startswith("single:")}
    single = best_single(ranked)
    acc = {m: accuracy(r) for m, r in dev.items()} | {m: accuracy(r) for m, r in ranked.items()}
    others = [m for m in dev if not m.startswith("single:")]
    n, member_n = len(dev[single]), len(ranked[single])
    if not others:
        return Choice(single, single, None, None, acc, n, member_n)
    challenger = max(others, key=lambda m: acc[m])
    gain = paired_bootstrap(*paired_correct(dev[challenger], dev[single]), level=LEVEL)
    chosen = challenger if gain[1] > 0 else single
    return Choice(chosen, single, challenger, gain, acc, n, member_n)


def chosen_config(cfg, spec: MethodSpec):
    """The ``EnsembleConfig`` of a chosen row or candidate (members with weight 0 left out), or
    ``None`` for an output-level or answer-level row."""
    from tokenfuse.config import parse_config

    if spec.kind in ("output", "answers"):
        return None
    if spec.name.startswith("single:"):
        keep = {spec.members[0]}
        data = cfg.model_dump() | {"primary": None, "gate": None, "threshold": None}
    else:
        variant = cfg.with_overrides(**spec.overrides, origin=f"auto {spec.name}")
        keep = {m.name for m in variant.members if m.weight > 0} | ({variant.gate} if variant.gate else set())
        data = variant.model_dump()
    data["members"] = [m for m in data["members"] if m["name"] in keep]
    return parse_config(data, origin=f"auto {spec.name}")


def config_text(config, choice: Choice, *, task: str, note: str | None = None) -> str:
    """The chosen config as YAML under a comment header with the dev accuracies it was chosen on."""
    from tokenfuse.select import config_yaml

    head = [f"# Chosen by `tokenfuse eval`'s auto row on {task}: {choice.chosen}, on {choice.n} dev items "
            f"({choice.member_n} for the members alone; never the test items).",
            *([f"# Fewer than asked: {note}."] if note else []), "# dev accuracy of every candidate:"]
    def items(name: str) -> str:  # a member alone's accuracy is on its own (more) dev items
        return f" (on the members' {choice.member_n})" if name.startswith("single:") and choice.member_n != choice.n else ""

    head += [f"#   {name}: {100 * acc:.1f}{items(name)}" for name, acc in sorted(choice.dev_acc.items(), key=lambda t: -t[1])]
    return "\n".join(head) + "\n" + config_yaml(config)
