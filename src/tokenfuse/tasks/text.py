"""The ``text`` task: held-out documents scored in bits per byte (``tokenfuse eval --tasks text``).

Data: ``text/dev.jsonl`` and ``text/test.jsonl`` of the benchmark directory, one document per line,
``{"id", "domain", "source", "text"}`` (shared/benchmarks/README.md, "Held-out text"). Each
document's bytes are scored with nothing before them but each member's start token (BOS, else EOS);
dev documents fit the rows' weights and rates, test documents are reported.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from tokenfuse.tasks.base import TaskDataError, read_jsonl, resolve_data_dir

NAME = "text"
SPLITS = ("dev", "test")
FIELDS = ("id", "domain", "text")


@dataclass(frozen=True)
class Document:
    id: str
    domain: str
    text: str

    @property
    def nbytes(self) -> int:
        return len(self.text.encode("utf-8"))


def load_documents(split: str, data_dir: str | os.PathLike | None = None) -> list[Document]:
    """The split's documents in file order; a line without a field names the file, line and field."""
    if split not in SPLITS:
        raise TaskDataError(f"text: unknown split {split!r} (one of {', '.join(SPLITS)})")
    root = resolve_data_dir(data_dir)
    rel = f"{NAME}/{split}.jsonl"
    docs = []
    seen: set[str] = set()
    for n, item in enumerate(read_jsonl(root, rel), 1):
        for key in FIELDS:
            if not isinstance(item.get(key), str) or (key != "text" and not item[key]):
                raise TaskDataError(f"{root / rel}: document {n} has no string field {key!r} "
                                    f"(each line is {{\"id\", \"domain\", \"source\", \"text\"}})")
        if item["id"] in seen:
            raise TaskDataError(f"{root / rel}: document {n}: id {item['id']!r} appears twice")
        seen.add(item["id"])
        docs.append(Document(item["id"], item["domain"], item["text"]))
    return docs
