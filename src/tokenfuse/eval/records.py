"""Per-item predictions on disk: one JSONL file per task, form and method; a rerun skips finished items.

Layout under ``--out``: ``items/<task>-<form>/<method>.jsonl`` (``single:<member>`` is written
``single__<member>``). Each line is one finished item, appended and flushed as soon as its batch is
done, so an interrupted run loses at most one batch. A line that does not parse (cut off by an
interrupt) is ignored and its item runs again.

Beside each engine row's records, ``<method>.spec.json`` holds the configuration that made them (its
members and overrides, ``keep_if_made_by``): a rerun whose row of the same name is configured
otherwise (``auto``'s gated candidate with another gate, ``gac-threshold`` with another ``--gate``)
moves the old records aside, to ``<method>.jsonl.stale<k>``, and runs the row again instead of
resuming from records another configuration made. Records without the file (older runs) are kept.
"""

from __future__ import annotations

import json
from pathlib import Path


def task_dir(out: Path, task: str, form: str) -> Path:
    """The directory of one task's records in one form (``form`` ``generate-dev`` etc. for dev items)."""
    return Path(out) / "items" / f"{task}-{form}"


def item_file(out: Path, task: str, form: str, method: str) -> Path:
    return task_dir(out, task, form) / (method.replace(":", "__").replace("/", "_") + ".jsonl")


def read_records(path: Path) -> dict[str, dict]:
    """Finished records by item id (the last record of an id wins)."""
    done: dict[str, dict] = {}
    if not path.is_file():
        return done
    with path.open(encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and "id" in rec:
                done[str(rec["id"])] = rec
    return done


def append_records(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    cut_off = path.is_file() and path.stat().st_size > 0 and path.read_bytes()[-1:] != b"\n"
    with path.open("a", encoding="utf-8") as f:
        if cut_off:  # an interrupted line: end it, so the new record starts on its own line
            f.write("\n")
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        f.flush()


def keep_if_made_by(path: Path, spec: dict) -> Path | None:
    """Keep the records at ``path`` only if ``spec`` (JSON-able: the row's members and overrides)
    made them; otherwise move them aside (returns where to; nothing is deleted). Writes ``spec``
    beside the records, so the next run checks against it."""
    text = json.dumps(spec, sort_keys=True) + "\n"  # one canonical form: compared as text
    side = path.with_name(path.stem + ".spec.json")
    if side.is_file() and side.read_text(encoding="utf-8") == text:
        return None
    moved = None
    if side.is_file() and path.is_file():
        k = 1
        while path.with_name(f"{path.name}.stale{k}").exists():
            k += 1
        moved = path.rename(path.with_name(f"{path.name}.stale{k}"))
    side.parent.mkdir(parents=True, exist_ok=True)
    side.write_text(text, encoding="utf-8")
    return moved
