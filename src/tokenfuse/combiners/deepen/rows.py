"""Rows of a member's relative representation matrix R̂ (DeePEn §3.2), computed on demand.

``R̂[w] = softmax(T · r / ‖r‖₂)`` with ``r = cos(e_w, e_anchors)`` over the input embeddings (the
reference code's row L2 normalisation and temperature; see ``tokenfuse.combiners.deepen.relative``).

Why on demand and not a precomputed sparse matrix: with the reference's normalisation the rows are
*not* sharp. The L2 norm of a 38,547-long cosine row is 20–100, so ``T · r / ‖r‖`` spans only a few
units and every row spreads its mass over nearly all anchors (measured on the bundled models:
exp-entropy ≈ 38,000 of 38,547; the top 64 anchors hold 0.2–0.3 % of a row, the top 4,096 about
13 %; ``scripts/measure/measure_deepen.py``). Keeping the top-m anchors of each row therefore keeps almost
nothing of it, and a dense matrix does not fit (262,144 × 38,547 × 4 B ≈ 40 GB for Gemma-3). What
does fit: the normalised anchor embeddings (``A × d``, 89–138 MB per member in float32, half that
in bfloat16) and a bounded cache of the rows the ensemble actually asks for (the tokens that carry
probability mass), computed as
one ``[k, d] × [d, A]`` product per batch of new rows (float32, or bfloat16: 2–4× faster, ~1 %
relative error per entry) and kept as ``A · R̂`` in float16 (relative rounding ≤ 2⁻¹¹; every row
is read back through the store, so a cached and a fresh row are the same numbers). Computed rows
can be written to disk (``save``) so a later run starts warm; ``prebuild`` computes rows ahead.

Embeddings are read without copying a whole table, through ``member.embedding_rows()``
(``tokenfuse.members.embeddings.EmbeddingRows``: the transformers model's own input embedding, or
a GGUF file's ``token_embd.weight`` memory-mapped with only the needed rows dequantised).
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import numpy as np
import torch

from tokenfuse.members.codec import DAMAGED
from tokenfuse.members.embeddings import EmbeddingRows
from tokenfuse.paths import save_npz

VERSION = "1"


# ---------------------------------------------------------------------------------------- rows
def relative_rows(queries: torch.Tensor, anchors: torch.Tensor, temperature: float) -> torch.Tensor:
    """``R̂`` rows: ``softmax(T · r / ‖r‖₂)``, ``r = cos(queries, anchors)``.

    ``queries``: ``float32[k, d]`` raw embeddings; ``anchors``: ``[A, d]`` unit rows (float32, or
    bfloat16 for a product twice as fast at ~1 % relative error). Returns ``float32[k, A]``.
    """
    q = torch.nn.functional.normalize(queries, dim=1).to(anchors.dtype)
    r = (q @ anchors.T).float()
    r = torch.nn.functional.normalize(r, dim=1)
    r.mul_(temperature)
    return torch.softmax(r, dim=1)


class RelativeRows:
    """One member's ``R̂``, row by row: exact rows on demand, a bounded LRU store, an on-disk cache.

    Args:
        source: the member's embedding rows.
        anchor_ids: the member's ids of the anchors, in the shared column order.
        temperature: ``T`` in ``softmax(T · r / ‖r‖₂)``.
        capacity: rows kept in memory (each ``2 · A`` bytes in float16).
        cache_dir: where ``relative-<key>.npz`` (normalised anchor embeddings) and
            ``relative-<key>-rows.npz`` (rows written by ``save``) live; ``None``: no disk cache.
        row_dtype: storage type of the kept rows (``float16``: ``A · R̂`` rounded to 11 bits;
            ``float32``: exact, twice the memory).
        compute_dtype: type of the anchor matrix and the product that makes new rows
            (``float32``: exact; ``bfloat16``: half the memory, 2–4× faster, ~1 % relative error).
        label: for error messages and progress bars.
    """

    def __init__(self, source: EmbeddingRows, anchor_ids: np.ndarray, *, temperature: float = 100.0,
                 capacity: int = 4096, cache_dir: Path | None = None, row_dtype: torch.dtype = torch.float16,
                 compute_dtype: torch.dtype = torch.float32, label: str = "") -> None:
        self.source = source
        self.anchor_ids = np.ascontiguousarray(anchor_ids, dtype=np.int64)
        if len(self.anchor_ids) and (self.anchor_ids.min() < 0 or self.anchor_ids.max() >= source.n_rows):
            raise ValueError(f"{label}: anchor ids outside the embedding table ({source.n_rows} rows)")
        self.temperature = float(temperature)
        self.capacity = int(capacity)
        self.row_dtype = row_dtype
        self.compute_dtype = compute_dtype
        self.label = label
        self.n_anchors = len(self.anchor_ids)
        anchors_hash = hashlib.blake2b(self.anchor_ids.tobytes(), digest_size=12).hexdigest()
        self.key = hashlib.blake2b(f"{VERSION}|{source.key}|{anchors_hash}".encode(), digest_size=12).hexdigest()
        self.rows_key = hashlib.blake2b(f"{self.key}|T={self.temperature!r}|{compute_dtype}".encode(),
                                        digest_size=12).hexdigest()
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self._anchors: torch.Tensor | None = None
        self._store: torch.Tensor | None = None
        self._slot: dict[int, int] = {}
        self._slot_id = np.full(self.capacity, -1, dtype=np.int64)
        self._used = np.zeros(self.capacity, dtype=np.int64)
        self._clock = 0
        self._dirty = False
        # what happened, for reports
        self.hits = 0
        self.misses = 0
        self.compute_seconds = 0.0
        self.build_seconds = 0.0
        self.from_cache = False

    # ------------------------------------------------------------------ anchors (lazy)
    @property
    def anchor_matrix(self) -> torch.Tensor:
        """The normalised anchor embeddings, ``float32[A, d]`` (built or loaded on first use)."""
        if self._anchors is None:
            self.prepare()
        return self._anchors

    def _path(self, suffix: str = "") -> Path | None:
        if self.cache_dir is None:
            return None
        key = self.rows_key if suffix else self.key
        return self.cache_dir / f"relative-{key}{suffix}.npz"

    def prepare(self, *, progress: bool = False, chunk: int = 8192) -> None:
        """Load (or build and cache) the anchor matrix, and the rows saved by an earlier run."""
        if self._anchors is not None:
            return
        start = time.perf_counter()
        path = self._path()
        if path is not None and path.exists():
            try:
                with np.load(path) as z:
                    if np.array_equal(z["anchor_ids"], self.anchor_ids):
                        self._anchors = torch.from_numpy(z["anchors"]).to(self.compute_dtype)
                        self.from_cache = True
            except DAMAGED:
                self._anchors = None  # rebuilt below
        if self._anchors is None:
            from tokenfuse.progress import progress_bar

            out = torch.empty(self.n_anchors, self.source.dim, dtype=torch.float32)
            with progress_bar(total=self.n_anchors, desc=f"anchor embeddings {self.label}".rstrip(), unit="row",
                              enabled=progress, leave=False) as bar:
                for s in range(0, self.n_anchors, chunk):
                    ids = self.anchor_ids[s : s + chunk]
                    out[s : s + len(ids)] = torch.nn.functional.normalize(self.source.take(ids), dim=1)
                    bar.update(len(ids))
            if path is not None:  # float32 on disk whatever the compute type
                save_npz(path, anchor_ids=self.anchor_ids, anchors=out.numpy())
            self._anchors = out.to(self.compute_dtype)
        self._load_rows()
        self.build_seconds = time.perf_counter() - start

    # ------------------------------------------------------------------ rows
    def compute(self, ids: np.ndarray | list[int]) -> torch.Tensor:
        """Exact rows ``float32[k, A]``, not stored."""
        ids = np.asarray(ids, dtype=np.int64)
        if len(ids) and (ids.min() < 0 or ids.max() >= self.source.n_rows):
            raise IndexError(f"{self.label}: row ids outside the embedding table ({self.source.n_rows} rows)")
        return relative_rows(self.source.take(ids), self.anchor_matrix, self.temperature)

    def rows(self, ids: np.ndarray | list[int]) -> torch.Tensor:
        """Rows ``float32[k, A]`` of ``R̂`` for ``ids`` (repeats allowed), through the store."""
        return self.scaled_rows(ids).div_(self.n_anchors)

    def scaled_rows(self, ids: np.ndarray | list[int]) -> torch.Tensor:
        """``A · R̂`` rows, ``float32[k, A]`` (what the store holds; saves a pass over the rows)."""
        ids = np.asarray(ids, dtype=np.int64)
        uniq = np.unique(ids)
        if len(uniq) > self.capacity:
            return self._decode(self._encode(self.compute(ids)))
        if self._store is None:
            # torch.empty does not touch the pages: memory grows with the rows actually stored.
            self._store = torch.empty(self.capacity, self.n_anchors, dtype=self.row_dtype)
        missing = [int(i) for i in uniq if int(i) not in self._slot]
        self.hits += len(uniq) - len(missing)
        self.misses += len(missing)
        self._clock += 1
        protected = {self._slot[int(i)] for i in uniq if int(i) in self._slot}
        if missing:
            t = time.perf_counter()
            fresh = self.compute(missing)
            slots = self._free_slots(len(missing), protected)
            for i, s in zip(missing, slots):
                old = int(self._slot_id[s])
                if old >= 0:
                    del self._slot[old]
                self._slot[i] = s
                self._slot_id[s] = i
            self._store[torch.from_numpy(np.asarray(slots, dtype=np.int64))] = self._encode(fresh)
            self.compute_seconds += time.perf_counter() - t
            self._dirty = True
        slots = np.fromiter((self._slot[int(i)] for i in ids), dtype=np.int64, count=len(ids))
        self._used[slots] = self._clock
        # index_select, not store[slots]: 6× faster for a few dozen long rows
        return self._decode(torch.index_select(self._store, 0, torch.from_numpy(slots)))

    def _free_slots(self, n: int, protected: set[int]) -> list[int]:
        """``n`` slots: empty ones first, then the least recently used (never ``protected``)."""
        order = np.argsort(self._used, kind="stable")  # empty slots have _used == 0
        return [int(s) for s in order if int(s) not in protected][:n]

    def _encode(self, rows: torch.Tensor) -> torch.Tensor:
        """Exact rows -> what the store holds: ``A · R̂`` in ``row_dtype``."""
        return (rows * self.n_anchors).to(self.row_dtype)

    def _decode(self, stored: torch.Tensor) -> torch.Tensor:
        """Stored rows -> ``A · R̂`` in float32 (a new tensor)."""
        return stored.float() if stored.dtype != torch.float32 else stored.clone()

    def prebuild(self, ids: np.ndarray | list[int], *, batch: int = 256, progress: bool = False) -> int:
        """Compute and store the rows ``ids`` not stored yet (at most ``capacity``); returns how many."""
        from tokenfuse.progress import progress_bar

        todo = [int(i) for i in dict.fromkeys(np.asarray(ids, dtype=np.int64).tolist()) if int(i) not in self._slot]
        todo = todo[: self.capacity]
        with progress_bar(total=len(todo), desc=f"R̂ rows {self.label}".rstrip(), unit="row", enabled=progress,
                          leave=False) as bar:
            for s in range(0, len(todo), batch):
                chunk = todo[s : s + batch]
                self.scaled_rows(chunk)
                bar.update(len(chunk))
        return len(todo)

    @property
    def stored(self) -> int:
        return len(self._slot)

    # ------------------------------------------------------------------ persistence of rows
    def save(self) -> Path | None:
        """Write the stored rows (most recently used last) to ``relative-<key>-rows.npz``."""
        path = self._path("-rows")
        if path is None or not self._slot or not self._dirty:
            return None
        slots = np.array(sorted(self._slot.values(), key=lambda s: self._used[s]), dtype=np.int64)
        rows = torch.index_select(self._store, 0, torch.from_numpy(slots))
        save_npz(path, ids=self._slot_id[slots], rows=rows.numpy())
        self._dirty = False
        return path

    def _load_rows(self) -> None:
        path = self._path("-rows")
        if path is None or not path.exists():
            return
        try:
            with np.load(path) as z:
                ids, rows = z["ids"][-self.capacity :], z["rows"][-self.capacity :]
        except DAMAGED:
            return
        if rows.ndim != 2 or rows.shape[1] != self.n_anchors:
            return
        stored = torch.from_numpy(rows)
        if stored.dtype != self.row_dtype:  # saved with another storage type
            stored = stored.to(self.row_dtype)
        self._store = torch.empty(self.capacity, self.n_anchors, dtype=self.row_dtype)
        self._store[: len(ids)] = stored
        self._slot = {int(i): s for s, i in enumerate(ids.tolist())}
        self._slot_id[: len(ids)] = ids
        self._used[: len(ids)] = np.arange(1, len(ids) + 1) - len(ids) - 1  # older than anything new
        self._used[len(ids):] = np.iinfo(np.int64).min  # empty slots are taken first



