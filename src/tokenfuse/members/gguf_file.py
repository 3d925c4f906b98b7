"""The package's one GGUF reader: a file's header (metadata and tensor table), its tensor data mapped.

A GGUF file is a header — magic, version, the metadata key/value pairs, the tensor table (name,
dimensions, quantisation type, offset of each tensor) — then the aligned tensor data.
``read_gguf`` walks the header once; only the metadata values asked for are decoded (the others,
and all tensor data, are skipped), and the file stays memory-mapped for the tensors.
``gguf_tokenizer`` reads the tokenizer keys through ``read_gguf_metadata``; ``embeddings`` maps the
rows of ``token_embd.weight`` through ``gguf_tensor``.

``gguf.GGUFReader`` is not used: it decodes every metadata value at construction, and on the
bundled models (2 cores, median of 3) it took 4.2 s (SmolLM2), 17.4 s (Gemma-3, 262,144-entry
tokenizer arrays) and 10.6 s (Qwen2.5-Coder), against 0.07 / 0.26 / 0.21 s for the tokenizer
metadata here and 0.05 / 0.11 / 0.07 s for the embedding tensor. ``gguf`` itself supplies the
quantisation types and block sizes and, in ``embeddings``, the dequantisation.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokenfuse.errors import ModelLoadError

# GGUF metadata value types: the fixed-size ones (struct format, numpy dtype), then string and array.
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32  # gguf.GGUF_DEFAULT_ALIGNMENT: where general.alignment is absent


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One row of the tensor table."""

    name: str
    dims: tuple[int, ...]  # as the file writes them: the fastest-moving dimension first
    qtype: int  # gguf.GGMLQuantizationType value
    start: int  # byte offset of the tensor's data in the file


@dataclass(frozen=True)
class GGUFHeader:
    """What ``read_gguf`` found: the decoded metadata values, the tensor table, the file's memory map."""

    path: Path
    version: int
    metadata: dict[str, Any]  # only the keys asked for
    tensors: dict[str, GGUFTensorInfo]
    data: np.memmap  # the whole file, read-only


def read_gguf(path: str | os.PathLike, keep: Callable[[str], bool] = lambda key: False) -> GGUFHeader:
    """Walk a GGUF file's header; decode the metadata values whose key ``keep`` accepts.

    Values decode to ``str``, ``int``, ``float``, ``bool``, a list of ``str``, a numpy array (an array
    of numbers) or a list of those (nested arrays). Raises ``ModelLoadError`` on a file that is not
    GGUF version 2 or 3 or whose header holds an unknown value type.
    """
    path = Path(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    buf = memoryview(mm)
    if bytes(buf[:4]) != b"GGUF":
        raise ModelLoadError(f"{path}: not a GGUF file (no GGUF magic at the start)")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise ModelLoadError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
    unpack = struct.unpack_from

    def string(at: int, decode: bool = True) -> tuple[str | None, int]:
        (n,) = unpack("<Q", buf, at)
        return (bytes(buf[at + 8 : at + 8 + n]).decode("utf-8") if decode else None), at + 8 + n

    def value(vtype: int, at: int, decode: bool) -> tuple[Any, int]:
        if vtype in _SCALAR:
            return (unpack(_SCALAR[vtype], buf, at)[0] if decode else None), at + struct.calcsize(_SCALAR[vtype])
        if vtype == _STRING:
            return string(at, decode)
        if vtype != _ARRAY:
            raise ModelLoadError(f"{path}: unknown GGUF metadata value type {vtype}")
        etype, count = unpack("<IQ", buf, at)
        at += 12
        if etype in _SCALAR:
            end = at + count * struct.calcsize(_SCALAR[etype])
            return (np.frombuffer(mm, dtype=_NUMPY[etype], count=count, offset=at).copy() if decode else None), end
        items = []
        if etype == _STRING:  # inline: a vocabulary is hundreds of thousands of them
            for _ in range(count):
                (n,) = unpack("<Q", buf, at)
                if decode:
                    items.append(bytes(buf[at + 8 : at + 8 + n]).decode("utf-8"))
                at += 8 + n
            return (items if decode else None), at
        for _ in range(count):
            item, at = value(etype, at, decode)
            if decode:
                items.append(item)
        return (items if decode else None), at

    metadata: dict[str, Any] = {}
    alignment, pos = DEFAULT_ALIGNMENT, 24
    for _ in range(n_kv):
        key, pos = string(pos)
        (vtype,) = unpack("<I", buf, pos)
        wanted, is_alignment = keep(key), key == "general.alignment" and vtype in _SCALAR
        val, pos = value(vtype, pos + 4, wanted or is_alignment)
        if is_alignment:
            alignment = val
        if wanted:
            metadata[key] = val
    table = []
    for _ in range(n_tensors):
        name, pos = string(pos)
        (n_dims,) = unpack("<I", buf, pos)
        dims = unpack(f"<{n_dims}Q", buf, pos + 4)
        qtype, offset = unpack("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        table.append((name, dims, qtype, offset))
    data_start = (pos + alignment - 1) // alignment * alignment
    tensors = {name: GGUFTensorInfo(name, dims, qtype, data_start + offset) for name, dims, qtype, offset in table}
    return GGUFHeader(path, version, metadata, tensors, mm)


def read_gguf_metadata(path: str | os.PathLike, prefixes: tuple[str, ...] = ("tokenizer.", "general.")) -> dict:
    """The metadata values whose keys start with ``prefixes`` (strings, numbers, lists, numpy arrays).

    Only those values are decoded; every other value (and all tensor data) is skipped.
    """
    return read_gguf(path, lambda key: key.startswith(prefixes)).metadata


def gguf_tensor(path: str | os.PathLike, name: str = "token_embd.weight") -> tuple[np.ndarray, Any, tuple[int, int]]:
    """Locate one 2-D tensor in a GGUF file without decoding the metadata values.

    Returns ``(rows, qtype, (n_rows, n_cols))``: ``rows`` is a read-only ``uint8[n_rows, row_bytes]``
    memory map of the tensor's quantised rows, ``qtype`` its ``gguf.GGMLQuantizationType``. Raises
    ``ValueError`` when the file has no such tensor or it is not 2-D.
    """
    import gguf

    header = read_gguf(path)
    info = header.tensors.get(name)
    if info is None:
        raise ValueError(f"{path}: no tensor {name!r}")
    if len(info.dims) != 2:
        raise ValueError(f"{path}: {name} has {len(info.dims)} dimensions, expected 2")
    qtype = gguf.GGMLQuantizationType(info.qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n_cols, n_rows = info.dims
    row_bytes = n_cols // block * size
    rows = header.data[info.start : info.start + n_rows * row_bytes].reshape(n_rows, row_bytes)
    return rows, qtype, (n_rows, n_cols)
