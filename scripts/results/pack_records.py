"""Pack one task's `tokenfuse eval` records into `items-<task>.tar.gz`, as docs/results/ publishes them.

Takes `OUT/items/<task>-<form>/` and `OUT/items/<task>-<form>-dev/` (test and dev records), drops the
named fields from every record (by default `options`, the option texts, which the task gives again
when a run resumes), skips lines cut off by an interrupt, and writes `DEST/items-<task>.tar.gz`,
which unpacks into an eval's `--out` to resume or re-aggregate the run:
`tar xzf DEST/items-<task>.tar.gz -C OUT`. Each row's `<method>.spec.json` (the configuration that
made its records, `tokenfuse.eval.records.keep_if_made_by`) goes along as it is. Members and order are kept; the archive is the same bytes
for the same records (sorted names, no timestamps).

Keep `output` in a generate-form run that is still in progress (MBR compares the members' outputs);
published letter-form records drop it with `--strip options,output`.

Usage: .venv/bin/python scripts/results/pack_records.py gsm8k --out eval-large --dest docs/results/large/in-progress --form generate
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import sys
import tarfile
from pathlib import Path

from tokenfuse.eval.records import read_records, task_dir


def pack(task: str, out: Path, dest: Path, form: str, strip: list[str]) -> tuple[Path, int]:
    """Write DEST/items-TASK.tar.gz; returns its path and the number of records packed."""
    dirs = [d for d in (task_dir(out, task, form), task_dir(out, task, f"{form}-dev")) if d.is_dir()]
    if not dirs:
        raise SystemExit(f"error: no records of {task!r} in the {form} form under {out / 'items'} "
                         f"(expected {task}-{form}/ or {task}-{form}-dev/; check --out, TASK and --form)")
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / f"items-{task}.tar.gz"
    count = 0
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        def add(path: Path, data: bytes) -> None:
            info = tarfile.TarInfo(f"items/{path.parent.name}/{path.name}")
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))

        for d in dirs:
            for path in sorted(d.glob("*.jsonl")):
                lines = []
                for rec in read_records(path).values():
                    for field in strip:
                        rec.pop(field, None)
                    lines.append(json.dumps(rec, ensure_ascii=False) + "\n")
                add(path, "".join(lines).encode("utf-8"))
                count += len(lines)
            for path in sorted(d.glob("*.spec.json")):  # the configuration that made each row's records
                add(path, path.read_bytes())
    with target.open("wb") as f, gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0) as gz:
        gz.write(buf.getvalue())
    return target, count


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("task", help="task name, e.g. gsm8k")
    ap.add_argument("--out", type=Path, required=True, help="the eval's --out directory")
    ap.add_argument("--dest", type=Path, required=True, help="directory to write items-<task>.tar.gz into")
    ap.add_argument("--form", default="likelihood", choices=["likelihood", "generate"],
                    help="the records' form (default likelihood)")
    ap.add_argument("--strip", default="options",
                    help="comma-separated record fields to drop (default options; '' keeps everything)")
    args = ap.parse_args(argv)
    strip = [f for f in args.strip.split(",") if f]
    target, count = pack(args.task, args.out, args.dest, args.form, strip)
    print(f"{target}: {count} records", file=sys.stderr)


if __name__ == "__main__":
    main()
