"""The methods ``tokenfuse eval`` compares, and the two output-level baselines.

Method names (``--methods``):

| name | kind | what runs |
|---|---|---|
| ``single`` | engine | each member alone (rows ``single:<member>``), through the same engine |
| ``gac`` | engine | GaC every step (the config's weights) |
| ``gac-threshold`` | engine | thresholded GaC (the config's ``threshold``, ``gate`` and ``params.boundary``; else the primary member at 0.5) |
| ``unite`` | engine | UniTE (the config's ``params`` if its method is ``unite``) |
| ``deepen`` | engine | DeePEn, once a combiner named ``deepen`` is registered (skipped otherwise) |
| ``gac-conf`` | engine | GaC with per-step confidence weights (``params.confidence``, default ``entropy``) |
| ``gac-prompt`` | engine | GaC with PackLLM prompt weights (``prompt_weights`` τ 0.1, ``prompt_bytes`` 512) |
| ``safe`` | engine | GaC + SAFE (SAFE's Table 2): ``params.safe`` (the paper's defaults: chunks of 5, sharpening), the primary member drafting and gating at 0.5 |
| ``contrast`` | engine | contrastive decoding across tokenizers: the primary member the expert, the others amateurs (``alpha`` 0.1, ``beta`` 0.5) |
| ``byte-mix`` | engine | the ``byte`` method, ``mix: mixture`` (the config's weights): generation byte by byte; likelihood on bytes |
| ``byte-gate`` | engine | the ``byte`` method, ``mix: gate`` (the text fit: the bundled members' by default, or the config's ``params.fit`` when its method is ``byte``) |
| ``byte-online`` | engine | the same with ``mix: online`` (the gate whose bias learns from the text as it goes) |
| ``vote`` | output | majority over the members' extracted answers; a tie goes to the primary member |
| ``mbr`` | output | the member output with the highest mean chrF to the other members' outputs |
| ``seq-avg`` | output | likelihood form only: each option scored by the mean of the members' per-byte log-likelihoods |
| ``mux`` | answers | generate form only: SLM-MUX, each member samples ``k`` answers, the most self-consistent member's majority answer wins (``tokenfuse.eval.answers``) |
| ``sc`` | answers | generate form only: each member's own self-consistency over ``k × M`` samples (rows ``sc:<member>``), ``mux``'s budget-matched baseline |
| ``auto`` | auto | per task, the row or candidate configuration with the best accuracy on dev items only (``tokenfuse.eval.auto``) |

The adaptive rows (``gac-conf``, ``gac-prompt``, ``safe``) take the config's value of each of
their parameters when its method is ``gac`` and it sets one, else the default in ``ADAPTIVE_ROWS``; they are
not in the default ``--methods``; with them, the config's thresholded mode (``threshold``, ``gate``,
``params.boundary``) when its method is ``gac``. ``safe`` drafts with the primary member, which is also its
gate at ``threshold`` 0.5 (GaC in the paper ensembles only where the main model is below 0.5), without the
boundary rule; it drops the config's ``speculative`` (SAFE's rounds are its own).

``gac-select`` is the old name of ``gac-threshold`` with ``params.boundary: true`` (selective
ensembling): accepted, with a one-line message, under its old name (so its earlier runs resume).

The primary member (the gate of ``gac-threshold``, the expert of ``contrast``,
the tie-breaker of the votes, the likelihood form's segmentation) is, per task, the config's
``primary``, else its highest member ``score``, else the member best on the task's dev items
(``runner.task_primary``): every row that reads it gets it as an override (``plan_methods(primary=...)``).

Output-level methods are computed from the ``single`` rows of the same items, so they cost no
model time (the ``single`` rows are run for them even when ``single`` is not asked for). Answer-level
methods are computed from answers each member samples alone (``tokenfuse.eval.answers``), not from
the greedy ``single`` rows.

Likelihood form: ``vote`` takes the members' chosen options (per-byte normalised, or raw for the
raw accuracy); ``mbr`` picks among the members' chosen option texts by chrF, which for one word
options is close to the vote; ``gac-threshold`` gates each scored piece as in generation (the
gate's probability alone where it is confident, see ``Ensemble.loglikelihood``).
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any

from tokenfuse.errors import TokenfuseError

# adaptive GaC rows: the parameters each sets and their defaults (engine.strategies' Params)
ADAPTIVE_ROWS = {"gac-conf": {"confidence": "entropy"},
                 "gac-prompt": {"prompt_weights": 0.1, "prompt_bytes": 512},
                 "safe": {"safe": True}}
# the byte method's rows: the mixer each sets (the text-bytes rows' names)
BYTE_ROWS = {"byte-mix": "mixture", "byte-gate": "gate", "byte-online": "online"}
ENGINE_METHODS = ("gac", "gac-threshold", "unite", "deepen", *ADAPTIVE_ROWS, "contrast", *BYTE_ROWS)
# rows under an old name: what each is now (accepted with a one-line message)
OLD_ROWS = {"gac-select": "gac-threshold with params.boundary: true (--param boundary=true)"}
OUTPUT_METHODS = ("vote", "mbr", "seq-avg")
ANSWER_METHODS = ("mux", "sc")
ALL_METHODS = ("single", *ENGINE_METHODS, *OUTPUT_METHODS[:2], *ANSWER_METHODS, "auto")
DEFAULT_THRESHOLD = 0.5


@dataclass(frozen=True)
class MethodSpec:
    """One row of the results table.

    Attributes:
        name: the row name (``single:<member>``, ``gac``, ``vote``, ...).
        kind: ``engine`` (an ``Ensemble`` variant runs), ``output`` (computed from the singles),
            ``answers`` (computed from the members' sampled answers, ``tokenfuse.eval.answers``) or
            ``auto`` (a row or candidate chosen on dev items, ``tokenfuse.eval.auto``).
        members: member names the row uses (one for ``single`` and ``sc:<member>``).
        overrides: options for ``EnsembleConfig.with_overrides`` (``method``, ``gate``, ``threshold``).
    """

    name: str
    kind: str
    members: tuple[str, ...]
    overrides: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)


def parse_methods(text: str | Sequence[str]) -> list[str]:
    """``"single,gac,vote"`` -> the list, each name checked (a typo names itself and the choices)."""
    names = [m.strip() for m in (text.split(",") if isinstance(text, str) else text) if m.strip()]
    for n in names:
        if n in OLD_ROWS:
            warnings.warn(f"--methods: {n} is now {OLD_ROWS[n]}", FutureWarning, stacklevel=2)
        elif n not in ALL_METHODS and n != "seq-avg":
            from difflib import get_close_matches

            hint = get_close_matches(n, ALL_METHODS, n=1)
            raise TokenfuseError(f"--methods: unknown method {n!r}" + (f"; did you mean {hint[0]!r}?" if hint else "")
                                 + f" (methods: {', '.join(ALL_METHODS)})")
    if not names:
        raise TokenfuseError("--methods: give at least one method")
    return list(dict.fromkeys(names))


def plan_methods(cfg, names: Sequence[str], *, form: str, registered: Sequence[str],
                 log: Callable[[str], None] = print, primary: str | None = None,
                 threshold: float | None = None) -> list[MethodSpec]:
    """The rows to run for ``names`` on config ``cfg`` in ``form`` (``generate``/``likelihood``).

    Engine methods whose combiner is not registered are skipped with a message, as are ``mux`` and
    ``sc`` in the likelihood form; singles come first (output-level rows need them); ``sc`` is one
    row ``sc:<member>`` per member.
    ``primary``: the task's primary member (``runner.task_primary``), written into every ensemble
    row's overrides (so its records say which member gated, drafted or led); default the config's.
    ``threshold``: ``gac-threshold``'s where the config has no gate (default its own, else 0.5).
    """
    members = tuple(m.name for m in cfg.members)
    want_single = ("single" in names or "auto" in names or any(n in OUTPUT_METHODS for n in names)
                   or form == "likelihood")
    specs = [MethodSpec(f"single:{m}", "engine", (m,)) for m in members] if want_single else []
    pinned = {"primary": primary} if primary is not None else {}
    primary = primary or cfg.primary_name
    for n in names:
        if n in ("single", "auto"):
            continue
        if n in ANSWER_METHODS:
            if form != "generate":
                log(f"{n}: skipped (it samples answers, so it runs in the generate form; this task runs in the "
                    f"{form} form: --mc generate runs the multiple-choice tasks as letters)")
                continue
            specs += ([MethodSpec("mux", "answers", members)] if n == "mux" else
                      [MethodSpec(f"sc:{m}", "answers", (m,)) for m in members])
            continue
        if n in OUTPUT_METHODS:
            if n == "seq-avg" and form != "likelihood":
                log("seq-avg: skipped (a likelihood-form baseline; this task runs in the generate form)")
                continue
            specs.append(MethodSpec(n, "output", members))
            continue
        combiner = "gac" if n in ("gac-threshold", *OLD_ROWS) or n in ADAPTIVE_ROWS else "byte" if n in BYTE_ROWS else n
        if combiner not in registered:
            log(f"{n}: skipped (no combiner {combiner!r} is registered; available: {', '.join(sorted(registered))})")
            continue
        if n in ("gac-threshold", *OLD_ROWS):
            own = cfg.threshold if cfg.threshold is not None else threshold
            over = {"method": "gac", "gate": cfg.gate or primary,
                    "threshold": own if own is not None else DEFAULT_THRESHOLD}
            if n == "gac-select":
                over["params"] = {"boundary": True}
        elif n in ADAPTIVE_ROWS:
            own = cfg.params if cfg.method == "gac" else {}
            over = {"method": "gac", "params": {k: own[k] if own.get(k) is not None else v
                                                for k, v in ADAPTIVE_ROWS[n].items()}}
            if cfg.method != "gac":  # the config's thresholded mode comes with its gac parameters
                over.update(gate=None, threshold=None)
            if n == "safe":  # GaC + SAFE: the primary drafts and gates (SAFE revises no choice: no boundary rule)
                over.update(primary=primary, gate=primary, threshold=DEFAULT_THRESHOLD, speculative=None)
                over["params"]["boundary"] = False
        elif n in BYTE_ROWS:
            fit = {"fit": cfg.params["fit"]} if cfg.method == "byte" and cfg.params.get("fit") else {}
            over = {"method": "byte", "gate": None, "threshold": None, "params": {"mix": BYTE_ROWS[n]} | fit}
        else:  # the config's params carry over only to its own method (EnsembleConfig.with_overrides)
            over = {"method": n, "gate": None, "threshold": None}  # every step: thresholded mode is gac-threshold's
            if n == cfg.method and cfg.params.get("boundary"):
                over["params"] = {"boundary": False}
        specs.append(MethodSpec(n, "engine", members, over | pinned))
    if form == "likelihood" and len(members) > 1 and "seq-avg" not in [s.name for s in specs]:
        specs.append(MethodSpec("seq-avg", "output", members))  # the issue's sequence-level baseline, always shown
    if len(members) < 2:  # nothing to vote over, average or multiplex (a member's own self-consistency stays)
        specs = [s for s in specs if s.kind == "engine" or s.name.startswith("sc:")]
    if "auto" in names:
        specs.append(MethodSpec("auto", "auto", members))
    return specs


# ---------------------------------------------------------------------------------------- voting
def answer_key(extracted: str | None) -> str | None:
    """The form in which two extracted answers count as the same vote.

    Numbers compare numerically (``18`` = ``18.0``); other answers by SQuAD normalisation
    (case, punctuation, articles, whitespace). ``None`` or an empty answer casts no vote.
    """
    if extracted is None:
        return None
    try:
        return "#" + format(Decimal(extracted.replace(",", "")).normalize(), "f")
    except (InvalidOperation, ValueError):
        pass
    from tokenfuse.tasks.scoring import normalize_answer

    # A lone letter is an option ("A" would vanish as an article under SQuAD normalisation).
    key = normalize_answer(extracted) or " ".join(extracted.lower().split())
    return key or None


def majority_vote(answers: Sequence[str | None], *, primary: int = 0) -> int:
    """Index of the member whose answer wins the majority vote over ``answers``.

    Answers are compared by ``answer_key``; ``None`` abstains. Among answers with the most votes
    the primary member's wins if it is one of them, else the one given first (member order). If
    every member abstains, the primary member's output is taken.
    """
    keys = [answer_key(a) for a in answers]
    counts = Counter(k for k in keys if k is not None)
    if not counts:
        return primary
    top = max(counts.values())
    order = [primary] + [i for i in range(len(keys)) if i != primary]
    return next(i for i in order if keys[i] is not None and counts[keys[i]] == top)


def chrf_matrix(outputs: Sequence[str]) -> list[list[float]]:
    """``m[i][j]`` = sentence chrF (sacrebleu defaults, 0..100) of ``outputs[i]`` against ``outputs[j]``."""
    try:
        from sacrebleu.metrics import CHRF
    except ImportError:
        raise TokenfuseError("mbr needs sacrebleu: pip install 'tokenfuse[eval]'") from None
    chrf = CHRF()
    n = len(outputs)
    return [[chrf.sentence_score(outputs[i], [outputs[j]]).score if i != j else 100.0 for j in range(n)]
            for i in range(n)]


def mbr_select(outputs: Sequence[str], *, primary: int = 0) -> int:
    """Index of the minimum-Bayes-risk output: the highest mean chrF against the other outputs.

    Ties go to the primary member, then member order. With one output it is that output.
    """
    n = len(outputs)
    if n < 2:
        return 0
    m = chrf_matrix(outputs)
    means = [sum(m[i][j] for j in range(n) if j != i) / (n - 1) for i in range(n)]
    best = max(means)
    order = [primary] + [i for i in range(n) if i != primary]
    return next(i for i in order if means[i] >= best - 1e-9)
