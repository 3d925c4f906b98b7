"""Dev records shared across runs: the same row on the same dev item computes once per machine.

``tokenfuse eval`` runs rows on dev items to choose a task's primary member and ``auto``'s
configuration (``runner.task_primary``, ``runner.choose_on_dev``). Under one ``--out`` those
records resume like any other (``items/<task>-<form>-dev/``); this cache also gives them to a run
with another ``--out``: before an engine row runs on dev items, the records the cache holds for it
are copied into ``--out`` (so ``--out`` stays complete on its own), and every record it then computes
is added to the cache. Nothing else is cached (not the test items, not the sampled answers).

Layout: ``<cache>/eval-dev/<task>-<form>/<key>/`` (``<cache>``: ``tokenfuse.paths.cache_dir``),
``key.json`` what the key was made from and ``records.jsonl`` one line ``{"id": <item key>,
"record": {...}}`` per computed record. Keys (``row_key``, ``item_key``; sha256 of canonical JSON):

* the row: tokenfuse's version, the task, the form, the generation limit (generate form); for a
  member alone its member config (less ``weight`` and ``score``), ``window`` and ``scoring``, for any
  other row the whole configuration of the row (``EnsembleConfig.with_overrides`` of its overrides:
  members, weights, method, parameters, gate, primary); and every member it uses as loaded
  (``member_identity``: its class, its weight files' paths, sizes and modification times, its
  vocabulary's fingerprint, its weights' size, device and dtype);
* the item: its own JSON and exactly what the members see of it — the likelihood form's context,
  continuations and gold option; the generate form's raw prompt, chat messages and stop strings
  (so the shots and ``--num-fewshot`` are in it).

A row whose member has no weight files to name (a model built in memory, a model behind a server) is
not cached. A record is only ever taken for the row and item it was computed for, and it is taken
unchanged (only its ``method`` is the row's name), so a run that reuses records makes the choice
that computing them again makes (same records, same choice). ``tokenfuse eval`` uses it
(``--no-dev-cache`` turns it off); ``run_eval`` with ``EvalSettings(dev_cache=True)``. To drop it,
delete ``<cache>/eval-dev``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

from tokenfuse.eval.methods import MethodSpec
from tokenfuse.eval.records import append_records, read_records

DIR = "eval-dev"


def digest(value) -> str:
    """sha256 of ``value``'s canonical JSON."""
    text = json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def member_identity(member) -> dict | None:
    """What a loaded member's numbers come from (``None``: no weight files to name, not cacheable):
    a llama.cpp member's GGUF (``path``), a transformers member's model directory or file
    (``model.config._name_or_path``), each file with its size and modification time."""
    model = getattr(member, "model", None)
    where = getattr(member, "path", None) or getattr(getattr(model, "config", None), "_name_or_path", None)
    if not where or not Path(where).exists():
        return None
    root = Path(where).resolve()
    files = [root] if root.is_file() else sorted(f for f in root.iterdir() if f.is_file())
    if not files:
        return None
    stats = [(str(f), f.stat()) for f in files]
    return {"class": type(member).__name__, "files": [[f, st.st_size, st.st_mtime_ns] for f, st in stats],
            "codec": getattr(getattr(member, "codec", None), "fingerprint", None),
            "weight_bytes": member.weight_bytes, "device": str(getattr(member, "device", "")),
            "dtype": str(getattr(model, "dtype", ""))}


def row_key(cfg, base, spec: MethodSpec, *, task: str, form: str, max_new_tokens: int | None) -> dict | None:
    """What ``spec``'s records on ``task``'s dev items come from (module docstring); ``None`` when a
    member it uses is not cacheable."""
    from tokenfuse import __version__

    single = spec.name.startswith("single:")
    used = [m for m in base.members if (m.name == spec.members[0] if single else True)]
    identities = [member_identity(m) for m in used]
    if not used or any(i is None for i in identities):
        return None
    if single:
        member = next(mc for mc in cfg.members if mc.name == spec.members[0])
        config = {"member": member.model_dump(exclude={"weight", "score"}), "window": cfg.window,
                  "scoring": cfg.scoring}
    else:
        config = cfg.with_overrides(**spec.overrides, origin=f"method {spec.name}").model_dump()
    return {"version": __version__, "task": task, "form": form, "kind": spec.kind,
            "max_new_tokens": max_new_tokens if form == "generate" else None, "config": config,
            "members": dict(zip([m.name for m in used], identities))}


def item_key(task, item: dict, form: str) -> str:
    """The item's own JSON and what the members see of it (module docstring)."""
    if form == "likelihood":
        c = task.cloze(item)
        seen = [c.context, list(c.continuations), c.gold]
    else:
        seen = [task.raw_prompt(item), task.chat_messages(item), task.stop(chat=False), task.stop(chat=True)]
    return digest([item, seen])


class DevCache:
    """One task's dev records in one form, shared across runs (module docstring)."""

    def __init__(self, root: Path, task, form: str, items: Sequence[dict]) -> None:
        self.root = Path(root) / DIR / f"{task.name}-{form}"
        self.keys = {str(it["id"]): item_key(task, it, form) for it in items}

    def file(self, key: dict) -> Path:
        folder = self.root / digest(key)[:24]
        if not (folder / "key.json").is_file():
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "key.json").write_text(json.dumps(key, sort_keys=True, indent=1, default=str) + "\n",
                                             encoding="utf-8")
        return folder / "records.jsonl"

    def fill(self, key: dict, path: Path, name: str) -> int:
        """Append to ``path`` (a row's records under ``--out``) the cached records of the items it lacks;
        returns how many."""
        done = read_records(path)
        cached = {k: line["record"] for k, line in read_records(self.file(key)).items()}
        taken = [{**cached[k], "method": name} for i, k in self.keys.items() if i not in done and k in cached]
        if taken:
            append_records(path, taken)
        return len(taken)

    def add(self, key: dict, records: Sequence[dict]) -> None:
        """Add records this run computed (one write, so that runs appending at once keep whole lines)."""
        lines = "".join(json.dumps({"id": self.keys[str(r["id"])], "record": r}, ensure_ascii=False) + "\n"
                        for r in records)
        fd = os.open(self.file(key), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, lines.encode("utf-8"))
        finally:
            os.close(fd)

