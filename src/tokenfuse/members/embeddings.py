"""A member's input-embedding table, read row by row without materialising it.

``EmbeddingRows`` is what ``Member.embedding_rows()`` returns for members with local weights: a
transformers model's own input-embedding tensor, or a GGUF file's ``token_embd.weight``
(memory-mapped, located by ``tokenfuse.members.gguf_file.gguf_tensor``; only the rows asked for
are dequantised with ``gguf.quants``). DeePEn reads its anchors and the rows it needs through it;
``Member.input_embeddings()`` is the whole table.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
import torch

from tokenfuse.members.gguf_file import gguf_tensor


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
