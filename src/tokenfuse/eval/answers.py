"""``tokenfuse eval``'s answer-level rows: ``mux`` (SLM-MUX) and ``sc:<member>`` (self-consistency).

Both choose among whole *answers* sampled from the members alone, never among tokens, so they run
only in the generate form. The samples come first, then the rows are computed from them without
more model time:

* **Samples** (rows ``samples:<member>``, ``items/<task>-<form>/samples__<member>.jsonl``): each
  member alone (its own prompt form, as its ``single`` row) samples ``n`` answers per item at
  temperature ``T`` (default ``DEFAULT_TEMPERATURE`` 0.7, no top-k/top-p). Sample ``j`` of item
  ``i`` by member ``m`` is drawn with its own generator seeded ``sample_seed(seed, i, m, j)`` (a
  hash of the run's ``--seed``, the item id, the member's name and ``j``), so a sample never
  depends on its batch, its position in it or how many samples are drawn: a run is reproducible,
  resumes item by item, and a record drawn for fewer samples is extended by the missing indices
  alone (its first samples are those a fresh run draws). A member's samples of one or more items
  are drawn in one ``generate`` call (whole items per call, as many as fit in ``--batch-size``
  sequences, at least one item's ``n``). A record holds every sample's output, extracted answer,
  correctness and generated pieces, and the seconds they took.
* **Budget**: with ``k`` samples (``--samples``, default ``DEFAULT_SAMPLES`` 5) and ``M`` members,
  ``mux`` uses the first ``k`` samples of every member (``k × M`` in all) and ``sc:<member>`` the
  first ``k × M`` of that one member: the same number of samples, so ``sc`` is the budget-matched
  baseline. The samples are shared (``mux``'s are the first ``k`` of each ``sc``'s), so a member
  draws ``k × M`` per item when ``sc`` is asked, ``k`` when only ``mux`` is. Each record says how
  many samples it used (``samples``).

Rules (answers compared by ``methods.answer_key``; a sample without an extracted answer casts no vote):

* ``sc`` (``sc_pick``): the most frequent answer among the member's samples; among equally frequent
  answers the one sampled first. No answer at all: its first sample (unanswered).
* ``mux`` (``mux_pick``), SLM-MUX (Wang et al., "SLM-MUX: Orchestrating Small Language Models for
  Reasoning", arXiv 2510.05077, Sec. 3, and its workflow page slm-mux.github.io): each member's
  most frequent answer ``y_i*`` among its ``k`` samples (ties: the one sampled first) and its
  frequency ``s_i = f_i(y_i*)`` (its consistency, here the count: ``k`` is the same for every
  member); the member with the highest ``s_i`` wins and ``y_i*`` is the output. Ties between
  members go, as in the paper, to the member with the higher validation accuracy: the eval's
  ``primary`` member (the runner passes the member it ranks first), then member order. No member
  answering: the primary member's first sample. With ``k = 1`` every answering member has
  consistency 1, so ``mux`` is the primary member's answer if it gave one, else the first answering
  member's in member order.

Cost: a row's ``seconds`` are the time of the samples it uses (a member's sampling time per item
prorated over its samples), so its ``items/min`` is what the row alone costs; ``sampling_seconds``
is the time of every member's samples of the item, what the task's wall time counts once
(``summary.task_wall``).
"""

from __future__ import annotations

import hashlib
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path

from tokenfuse.eval.methods import MethodSpec, answer_key
from tokenfuse.eval.records import append_records, item_file, keep_if_made_by, read_records
from tokenfuse.progress import progress_bar
from tokenfuse.tasks import generate_graded, prompt_form

DEFAULT_SAMPLES = 5
DEFAULT_TEMPERATURE = 0.7


def sample_seed(seed: int, item_id, member: str, j: int) -> int:
    """The seed of sample ``j`` of item ``item_id`` by ``member`` in a run seeded ``seed``: the first
    63 bits of SHA-256 of ``"<seed>/<item id>/<member>/<j>"`` (stable across runs and machines)."""
    digest = hashlib.sha256(f"{seed}/{item_id}/{member}/{j}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def samples_needed(specs: Sequence[MethodSpec], k: int, width: int) -> dict[str, int]:
    """Samples per item each member draws for the answer rows ``specs`` with ``width`` (``M``)
    members in all (module docstring: ``mux`` takes ``k`` of each member, ``sc:<member>`` ``k × M``
    of its own)."""
    need: dict[str, int] = {}
    for s in specs:
        for m in (s.members if s.name == "mux" else s.members[:1]):
            need[m] = max(need.get(m, 0), k if s.name == "mux" else k * width)
    return need


# ---------------------------------------------------------------------------------------- the rules
def majority(keys: Sequence[str | None]) -> tuple[int | None, int]:
    """``(index of the first sample giving the most frequent key, its count)``; ``(None, 0)`` when
    every sample abstains (``None``)."""
    counts = Counter(k for k in keys if k is not None)
    if not counts:
        return None, 0
    top = max(counts.values())
    return next(i for i, k in enumerate(keys) if k is not None and counts[k] == top), top


def sc_pick(answers: Sequence[str | None]) -> tuple[int, int]:
    """Self-consistency over one member's ``answers``: ``(chosen sample, its votes)`` (module docstring)."""
    i, votes = majority([answer_key(a) for a in answers])
    return (0 if i is None else i), votes


def mux_pick(answers: Sequence[Sequence[str | None]], *, primary: int = 0) -> tuple[int, int, list[int]]:
    """SLM-MUX over the members' ``answers`` (``answers[m][j]``: member ``m``'s sample ``j``):
    ``(chosen member, chosen sample, every member's consistency)`` (module docstring)."""
    picks = [majority([answer_key(a) for a in xs]) for xs in answers]
    consistency = [c for _, c in picks]
    top = max(consistency)
    order = [primary] + [i for i in range(len(answers)) if i != primary]
    m = next(i for i in order if consistency[i] == top)
    return m, (0 if picks[m][0] is None else picks[m][0]), consistency


def answer_record(spec: MethodSpec, item_id, samples: Mapping[str, dict], *, k: int, width: int,
                  primary: str) -> dict:
    """A ``mux`` or ``sc:<member>`` record from every member's sample record of one item
    (``samples[member]``) with ``k`` and ``width`` (``M``) of ``samples_needed``; ``primary``
    breaks ``mux``'s ties between members."""
    if spec.name == "mux":
        names = list(spec.members)
        used = {m: k for m in names}
        m, j, consistency = mux_pick([samples[n]["extracted"][:k] for n in names],
                                     primary=names.index(primary) if primary in names else 0)
        chosen, extra = names[m], {"chosen": names[m], "consistency": consistency}
    else:
        chosen = spec.members[0]
        used = {chosen: k * width}
        j, votes = sc_pick(samples[chosen]["extracted"][:used[chosen]])
        extra = {"votes": votes}
    r = samples[chosen]
    seconds = sum(samples[n]["seconds"] * u / len(samples[n]["extracted"]) for n, u in used.items())
    return {"id": item_id, "output": r["outputs"][j], "extracted": r["extracted"][j], "correct": r["correct"][j],
            **extra, "samples": sum(used.values()), "steps": sum(sum(samples[n]["steps"][:u]) for n, u in used.items()),
            "seconds": round(seconds, 4), "sampling_seconds": round(sum(s["seconds"] for s in samples.values()), 4)}


# ---------------------------------------------------------------------------------------- sampling
def draw(ens, task, wanted: Sequence[tuple[dict, range]], *, member: str, seed: int, temperature: float,
         max_new_tokens: int) -> list[dict]:
    """Samples ``js`` of each ``(item, js)`` in ``wanted`` by the member alone ``ens``, in one
    ``generate`` call; one partial record per item (its samples ``js`` only)."""
    from tokenfuse.engine import Sampling

    flat = [(it, j) for it, js in wanted for j in js]
    t0 = time.perf_counter()
    graded = generate_graded(ens, task, [it for it, _ in flat], chat=prompt_form(ens.members),
                             max_new_tokens=max_new_tokens,
                             sampling=[Sampling(temperature=temperature, seed=sample_seed(seed, it["id"], member, j))
                                       for it, j in flat])
    per_sample = (time.perf_counter() - t0) / max(len(flat), 1)
    out, at = [], 0
    for it, js in wanted:
        mine = graded[at:at + len(js)]
        at += len(js)
        out.append({"id": it["id"], "member": member, "outputs": [g.text for g in mine],
                    "extracted": [g.score.extracted for g in mine], "correct": [bool(g.score.correct) for g in mine],
                    "steps": [g.generation.steps for g in mine], "seconds": per_sample * len(js)})
    return out


def merged(old: dict | None, new: dict) -> dict:
    """``old``'s samples followed by ``new``'s (the next indices), seconds added."""
    if old is None:
        return {**new, "seconds": round(new["seconds"], 4)}
    rec = {**old, "seconds": round(old["seconds"] + new["seconds"], 4)}
    for key in ("outputs", "extracted", "correct", "steps"):
        rec[key] = list(old[key]) + list(new[key])
    return rec


def run_samples(singles: Mapping[str, object], task, need: Mapping[str, int], items: Sequence[dict], *, out: Path,
                where: str, seed: int, temperature: float, max_new_tokens: int, batch_size: int,
                progress: bool = False) -> dict[str, dict[str, dict]]:
    """Draw (or resume) ``need[member]`` samples per item of each member (``singles[member]``: the
    member alone); returns each member's sample records by item id. Records another configuration
    drew (temperature, seed, generation limit) are moved aside (``records.keep_if_made_by``)."""
    paths = {m: item_file(out, task.name, where, f"samples:{m}") for m in need}
    for m, path in paths.items():
        made_by = {"member": m, "temperature": temperature, "seed": seed, "max_new_tokens": max_new_tokens}
        moved = keep_if_made_by(path, made_by)
        if moved is not None:
            print(f"{task.name}-{where} samples:{m}: drawn otherwise than asked; the records were moved to {moved} "
                  f"and the samples are drawn again", file=sys.stderr)
    have = {m: read_records(p) for m, p in paths.items()}

    def missing(m: str, it: dict) -> range:
        return range(len(have[m].get(str(it["id"]), {}).get("extracted", ())), need[m])

    pending = [it for it in items if any(missing(m, it) for m in need)]
    per_call = max(1, batch_size // max(need.values(), default=1))
    with progress_bar(total=len(items), desc=f"eval {task.name}-{where} (samples)", unit="item", enabled=progress,
                      initial=len(items) - len(pending)) as bar:
        for start in range(0, len(pending), per_call):
            batch = pending[start:start + per_call]
            for m in need:
                wanted = [(it, missing(m, it)) for it in batch if missing(m, it)]
                if not wanted:
                    continue
                new = [merged(have[m].get(str(r["id"])), r) for r in draw(
                    singles[m], task, wanted, member=m, seed=seed, temperature=temperature,
                    max_new_tokens=max_new_tokens)]
                append_records(paths[m], new)
                have[m].update({str(r["id"]): r for r in new})
            bar.update(len(batch))
    return have


def answer_rows(specs: Sequence[MethodSpec], samples: Mapping[str, Mapping[str, dict]], items: Sequence[dict], *,
                out: Path, task: str, where: str, k: int, width: int, primary: str) -> dict[str, list[dict]]:
    """Every answer row's records (in item order), written to its file anew (they are derived from
    the samples, which may have changed since the last run)."""
    rows = {}
    for spec in specs:
        rows[spec.name] = [{**answer_record(spec, it["id"], {m: per[str(it["id"])] for m, per in samples.items()},
                                            k=k, width=width, primary=primary), "method": spec.name} for it in items]
        path = item_file(out, task, where, spec.name)
        path.unlink(missing_ok=True)
        append_records(path, rows[spec.name])
    return rows
