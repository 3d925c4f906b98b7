"""scripts/results/pack_records.py: the published record tarballs unpack into `--out` as the records they came from."""

from __future__ import annotations

import importlib.util
import json
import tarfile
from pathlib import Path

import pytest

from tokenfuse.eval.records import append_records, item_file, keep_if_made_by, read_records

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("pack_records", ROOT / "scripts" / "results" / "pack_records.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(out: Path) -> None:
    test = [{"id": "t1", "output": " 4", "extracted": "4", "correct": True, "options": ["a"]},
            {"id": "t2", "output": " ¿5?", "extracted": "5", "correct": False, "options": ["b"]}]
    append_records(item_file(out, "gsm8k", "generate", "single:gemma3-270m"), test)
    append_records(item_file(out, "gsm8k", "generate-dev", "gac"), [{"id": "d1", "output": " 7", "correct": True}])
    keep_if_made_by(item_file(out, "gsm8k", "generate-dev", "gac"), {"members": ["a", "b"], "overrides": {"method": "gac"}})
    with item_file(out, "gsm8k", "generate", "gac").open("a", encoding="utf-8") as f:
        f.write(json.dumps(test[0]) + "\n" + '{"id": "t2", "outp')  # the last line cut off by an interrupt
    append_records(item_file(out, "piqa", "likelihood", "gac"), [{"id": "p1", "pred": 0}])  # another task: not packed


def test_pack_strips_the_named_fields_and_unpacks_into_the_records(tmp_path):
    out, dest, back = tmp_path / "run", tmp_path / "dest", tmp_path / "back"
    _write(out)
    target, count = _script().pack("gsm8k", out, dest, "generate", ["options"])
    assert target == dest / "items-gsm8k.tar.gz" and count == 4
    with tarfile.open(target) as tar:
        assert sorted(tar.getnames()) == ["items/gsm8k-generate-dev/gac.jsonl", "items/gsm8k-generate-dev/gac.spec.json",
                                          "items/gsm8k-generate/gac.jsonl", "items/gsm8k-generate/single__gemma3-270m.jsonl"]
        for member in tar.getmembers():  # unpacked by hand: extractall's filter= needs Python >= 3.11.4
            path = back / member.name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(tar.extractfile(member).read())
    single = read_records(item_file(back, "gsm8k", "generate", "single:gemma3-270m"))
    assert single == {"t1": {"id": "t1", "output": " 4", "extracted": "4", "correct": True},
                      "t2": {"id": "t2", "output": " ¿5?", "extracted": "5", "correct": False}}
    assert list(read_records(item_file(back, "gsm8k", "generate", "gac"))) == ["t1"]
    assert read_records(item_file(back, "gsm8k", "generate-dev", "gac")) == {"d1": {"id": "d1", "output": " 7", "correct": True}}
    assert json.loads((back / "items" / "gsm8k-generate-dev" / "gac.spec.json").read_text()) == \
        {"members": ["a", "b"], "overrides": {"method": "gac"}}
    first = target.read_bytes()
    _script().pack("gsm8k", out, dest, "generate", ["options"])
    assert target.read_bytes() == first  # the same records give the same archive


def test_pack_names_the_missing_records(tmp_path):
    with pytest.raises(SystemExit, match="no records of 'bbh' in the generate form"):
        _script().pack("bbh", tmp_path, tmp_path / "dest", "generate", [])
