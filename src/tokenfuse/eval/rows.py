"""The records of one row: what an engine row gives for a batch of items in each form, and the
output-level rows (vote, MBR, sequence-level average) computed from the members' records."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from tokenfuse.errors import TokenfuseError
from tokenfuse.eval.methods import MethodSpec, majority_vote, mbr_select
from tokenfuse.tasks import generate_graded


# ---------------------------------------------------------------------------------------- engine rows
def generate_records(ens, task, items: Sequence[dict], *, chat: bool | str, max_new_tokens: int) -> list[dict]:
    """Greedy generation for one batch, graded (``tokenfuse.tasks.generate_graded``); one record per item.
    ``max_new_tokens`` is in tokens: a method whose steps are bytes gets ``Combiner.steps_per_token`` steps
    for each."""
    t0 = time.perf_counter()
    graded = generate_graded(ens, task, items, chat=chat, max_new_tokens=max_new_tokens * ens.combiner.steps_per_token)
    per_item = (time.perf_counter() - t0) / max(len(items), 1)
    return [{"id": r.item["id"], "output": r.text, "extracted": r.score.extracted, "correct": bool(r.score.correct),
             "steps": r.generation.steps, "ensembled": r.generation.ensembled_steps,
             "skipped": r.generation.skipped_steps, "vetoed": r.generation.vetoed_steps,
             "finish": r.generation.finish_reason, "chat": chat, "seconds": round(per_item, 4)} for r in graded]


def argmax(values: Sequence[float]) -> int:
    """First index of the largest value (``-inf`` and NaN never win over a finite value)."""
    best, idx = -math.inf, 0
    for i, v in enumerate(values):
        if v == v and v > best:
            best, idx = v, i
    return idx


def cloze_record(item_id, gold: int, continuations: Sequence[str], logprobs: Sequence[float],
                 nbytes: Sequence[int], **extra) -> dict:
    """A likelihood-form record: the option scores and both predictions."""
    per_byte = [lp / max(b, 1) for lp, b in zip(logprobs, nbytes)]
    pred, pred_raw = argmax(per_byte), argmax(logprobs)
    return {"id": item_id, "gold": gold, "pred": pred, "pred_raw": pred_raw, "correct": pred == gold,
            "correct_raw": pred_raw == gold, "logprobs": [round(x, 5) for x in logprobs],
            "bytes": list(nbytes), "options": list(continuations), **extra}


def likelihood_records(ens, task, items: Sequence[dict], *, memo=None) -> list[dict]:
    """Every option of every item scored under ``ens`` (raw cloze context); one record per item.
    ``memo``: a ``RowMemo`` shared with the other rows scoring the same items."""
    clozes = [task.cloze(it) for it in items]
    requests = [(c.context, cont) for c in clozes for cont in c.continuations]
    t0 = time.perf_counter()
    liks = ens.loglikelihood(requests, memo=memo)
    per_item = (time.perf_counter() - t0) / max(len(items), 1)
    out, k = [], 0
    for it, c in zip(items, clozes):
        n = len(c.continuations)
        ls = liks[k:k + n]
        k += n
        out.append(cloze_record(it["id"], c.gold, c.continuations, [x.logprob for x in ls], [x.bytes for x in ls],
                                steps=sum(x.pieces for x in ls), ensembled=sum(x.ensembled for x in ls),
                                seconds=round(per_item, 4)))
    return out


# ---------------------------------------------------------------------------------------- output rows
def output_record(spec: MethodSpec, task, item: dict, singles: list[dict], *, primary: int, form: str) -> dict:
    """A vote / MBR / sequence-average record from the members' records of the same item."""
    names = list(spec.members)
    if form == "generate":
        if spec.name == "vote":
            k = majority_vote([r.get("extracted") for r in singles], primary=primary)
        else:
            stripped = [n for n, r in zip(names, singles) if "output" not in r]
            if stripped:
                raise TokenfuseError(
                    f"mbr: the records of {', '.join(stripped)} on {task.name} item {item['id']} have no 'output' "
                    f"(removed when they were packed), and MBR compares the members' outputs: delete those "
                    f"members' records (items/<task>-<form>/single__<member>.jsonl) to recompute them, or leave mbr out")
            k = mbr_select([r["output"] or "" for r in singles], primary=primary)
        r = singles[k]
        return {"id": item["id"], "output": r.get("output"), "extracted": r["extracted"], "correct": r["correct"],
                "chosen": names[k]}
    gold, options = singles[0]["gold"], list(task.cloze(item).continuations)  # the task's: packed records drop them
    if spec.name == "seq-avg":
        n = len(options)
        per_byte = [sum(r["logprobs"][j] / max(r["bytes"][j], 1) for r in singles) / len(singles) for j in range(n)]
        raw = [sum(r["logprobs"][j] for r in singles) / len(singles) for j in range(n)]
        nb = singles[0]["bytes"]
        rec = cloze_record(item["id"], gold, options, [p * max(b, 1) for p, b in zip(per_byte, nb)], nb)
        rec["pred_raw"] = argmax(raw)
        rec["correct_raw"] = rec["pred_raw"] == gold
        rec["logprobs"] = [round(x, 5) for x in raw]
        return rec
    picks = {}
    for key in ("pred", "pred_raw"):
        if spec.name == "vote":
            k = majority_vote([str(r[key]) for r in singles], primary=primary)
        else:
            k = mbr_select([options[r[key]] for r in singles], primary=primary)
        picks[key] = (singles[k][key], names[k])
    return {"id": item["id"], "gold": gold, "pred": picks["pred"][0], "pred_raw": picks["pred_raw"][0],
            "correct": picks["pred"][0] == gold, "correct_raw": picks["pred_raw"][0] == gold,
            "chosen": picks["pred"][1], "options": options}
