"""A member's input-embedding table, read row by row without materialising it.

``EmbeddingRows`` is what ``Member.embedding_rows()`` returns for members with local weights: a
transformers model's own input-embedding tensor, or a GGUF file's ``token_embd.weight``
(memory-mapped; only the rows asked for are dequantised with ``gguf.quants``). DeePEn reads its
anchors and the rows it needs through it; ``Member.input_embeddings()`` is the whole table.

``gguf.GGUFReader`` is not used: it parses every metadata field and took 9.7 s and 685 MB for
Gemma-3's 262,144-entry tokenizer arrays, so the small header walk below finds the one tensor instead.
"""

from __future__ import annotations

import hashlib
import os
import struct
from typing import Any

import numpy as np
import torch


# ---------------------------------------------------------------------------------------- GGUF
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def gguf_tensor(path: str | os.PathLike, name: str = "token_embd.weight") -> tuple[np.ndarray, Any, tuple[int, int]]:
    """Locate one 2-D tensor in a GGUF file without parsing the metadata values.

    Returns ``(rows, qtype, (n_rows, n_cols))``: ``rows`` is a read-only ``uint8[n_rows, row_bytes]``
    memory map of the tensor's quantised rows, ``qtype`` its ``gguf.GGMLQuantizationType``.
    """
    import gguf

    mm = np.memmap(path, dtype=np.uint8, mode="r")
    buf = memoryview(mm)
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version < 2:
        raise ValueError(f"{path}: GGUF version {version} is not supported")
    pos = 24
    alignment = gguf.GGUF_DEFAULT_ALIGNMENT

    def string(at: int) -> tuple[bytes, int]:
        (n,) = struct.unpack_from("<Q", buf, at)
        return bytes(buf[at + 8 : at + 8 + n]), at + 8 + n

    def skip(vtype: int, at: int) -> int:
        if vtype in _SCALAR:
            return at + struct.calcsize(_SCALAR[vtype])
        if vtype == _STRING:
            (n,) = struct.unpack_from("<Q", buf, at)
            return at + 8 + n
        if vtype == _ARRAY:
            etype, count = struct.unpack_from("<IQ", buf, at)
            at += 12
            if etype in _SCALAR:
                return at + count * struct.calcsize(_SCALAR[etype])
            for _ in range(count):
                at = skip(etype, at)
            return at
        raise ValueError(f"{path}: unknown GGUF value type {vtype}")

    for _ in range(n_kv):
        key, pos = string(pos)
        (vtype,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        if key == b"general.alignment" and vtype in _SCALAR:
            (alignment,) = struct.unpack_from(_SCALAR[vtype], buf, pos)
        pos = skip(vtype, pos)
    found = None
    for _ in range(n_tensors):
        tname, pos = string(pos)
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        qtype, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        if tname.decode() == name:
            found = dims, qtype, offset
    if found is None:
        raise ValueError(f"{path}: no tensor {name!r}")
    dims, qtype, offset = found
    if len(dims) != 2:
        raise ValueError(f"{path}: {name} has {len(dims)} dimensions, expected 2")
    start = (pos + alignment - 1) // alignment * alignment + offset
    qtype = gguf.GGMLQuantizationType(qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n_cols, n_rows = int(dims[0]), int(dims[1])
    row_bytes = n_cols // block * size
    rows = mm[start : start + n_rows * row_bytes].reshape(n_rows, row_bytes)
    return rows, qtype, (n_rows, n_cols)


# ---------------------------------------------------------------------------------------- embeddings
class EmbeddingRows:
    """Read access to one member's input-embedding rows (float32), never copying the whole table.

    Attributes:
        n_rows, dim: table shape.
        key: content hash of the table (every 16th row, shape and type), for cache keys.
    """

    def __init__(self, *, tensor: torch.Tensor | None = None, gguf_path: str | os.PathLike | None = None) -> None:
        if (tensor is None) == (gguf_path is None):
            raise ValueError("give exactly one of tensor= or gguf_path=")
        self._tensor = tensor.detach() if tensor is not None else None
        h = hashlib.blake2b(digest_size=12)
        if self._tensor is not None:
            self.n_rows, self.dim = self._tensor.shape
            h.update(f"tensor|{tuple(self._tensor.shape)}|{self._tensor.dtype}".encode())
            h.update(self._tensor[::16].float().cpu().contiguous().numpy().tobytes())
        else:
            self._rows, self._qtype, (self.n_rows, self.dim) = gguf_tensor(gguf_path)
            h.update(f"gguf|{self._rows.shape}|{self._qtype.name}".encode())
            h.update(np.ascontiguousarray(self._rows[::16]).tobytes())
        self.key = h.hexdigest()

    def take(self, ids: np.ndarray | list[int]) -> torch.Tensor:
        """``float32[len(ids), dim]``, the rows ``ids``."""
        ids = np.asarray(ids, dtype=np.int64)
        if self._tensor is not None:
            return self._tensor[torch.from_numpy(ids).to(self._tensor.device)].float().cpu()
        import gguf

        out = gguf.quants.dequantize(self._rows[ids], self._qtype)
        return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32).reshape(len(ids), self.dim))

    def all(self, *, chunk: int = 8192) -> torch.Tensor:
        """The whole table, ``float32[n_rows, dim]`` on the CPU (the model's own tensor when it already is that)."""
        if self._tensor is not None and self._tensor.dtype == torch.float32 and self._tensor.device.type == "cpu":
            return self._tensor
        out = torch.empty(self.n_rows, self.dim, dtype=torch.float32)
        for start in range(0, self.n_rows, chunk):
            stop = min(start + chunk, self.n_rows)
            out[start:stop] = self.take(np.arange(start, stop))
        return out
