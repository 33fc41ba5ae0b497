"""Streaming safetensors: read a tensor's rows or raw bytes, write a file tensor by tensor.

The format (github.com/huggingface/safetensors): an 8-byte little-endian header length, a JSON header
{name: {dtype, shape, data_offsets: [begin, end)}, "__metadata__": {str: str}}, then the data, each
tensor row-major at its offsets (relative to the end of the header). `safe_open` maps whole files and
`save_file` needs every tensor in memory; model preparation must stay far below the checkpoint size,
so it reads row ranges with plain file reads (nothing stays resident) and writes a header computed
up front, then each tensor's bytes in order, hashing as it goes.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "BF16": (torch.bfloat16, 2), "F16": (torch.float16, 2), "F32": (torch.float32, 4),
    "F64": (torch.float64, 8), "I8": (torch.int8, 1), "U8": (torch.uint8, 1), "I16": (torch.int16, 2),
    "I32": (torch.int32, 4), "I64": (torch.int64, 8), "BOOL": (torch.bool, 1),
    "F8_E4M3": (torch.float8_e4m3fn, 1), "F8_E5M2": (torch.float8_e5m2, 1),
}  # fmt: skip
NAMES = {dt: name for name, (dt, _) in DTYPES.items()}
COPY_CHUNK = 64 << 20  # raw copies move 64 MiB at a time


class SafetensorsError(ValueError):
    pass


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors name: BF16, I32, ...
    shape: tuple[int, ...]
    begin: int  # absolute file offsets of its bytes
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype][0]


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """(tensors by name, in file order; __metadata__) without reading any tensor data."""
    with path.open("rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise SafetensorsError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        (length,) = struct.unpack("<Q", raw)
        if length > 100 << 20:
            raise SafetensorsError(f"{path}: header of {length} bytes is not plausible")
        header = json.loads(fh.read(length))
    base = 8 + length
    meta = header.pop("__metadata__", None) or {}
    tensors = {}
    for name, h in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        if h["dtype"] not in DTYPES:
            raise SafetensorsError(f"{path}: tensor {name} has dtype {h['dtype']}, unknown here")
        b, e = h["data_offsets"]
        tensors[name] = TensorInfo(name, h["dtype"], tuple(h["shape"]), base + b, base + e)
    return tensors, meta


def read_rows(path: Path, info: TensorInfo, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of a tensor: a fresh tensor of shape [stop - start, *shape[1:]]."""
    row_elems = 1
    for d in info.shape[1:]:
        row_elems *= d
    itemsize = DTYPES[info.dtype][1]
    with path.open("rb") as fh:
        fh.seek(info.begin + start * row_elems * itemsize)
        data = bytearray(fh.read((stop - start) * row_elems * itemsize))
    return torch.frombuffer(data, dtype=info.torch_dtype).reshape(stop - start, *info.shape[1:])


def read_tensor(path: Path, info: TensorInfo) -> torch.Tensor:
    if not info.shape:
        with path.open("rb") as fh:
            fh.seek(info.begin)
            return torch.frombuffer(bytearray(fh.read(info.nbytes)), dtype=info.torch_dtype).reshape(())
    return read_rows(path, info, 0, info.shape[0])


def raw_chunks(path: Path, info: TensorInfo, chunk: int = COPY_CHUNK) -> Iterator[bytes]:
    with path.open("rb") as fh:
        fh.seek(info.begin)
        left = info.nbytes
        while left:
            block = fh.read(min(chunk, left))
            if not block:
                raise SafetensorsError(f"{path}: truncated inside tensor {info.name}")
            left -= len(block)
            yield block


@dataclass(frozen=True)
class Planned:
    """A tensor the writer will emit: its header entry, known before any data is written."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = DTYPES[self.dtype][1]
        for d in self.shape:
            n *= d
        return n


class StreamWriter:
    """Writes `planned` tensors, in that order, to `path` (via `path.tmp`, renamed by `close`).

    `write(name, data)` appends bytes or a tensor's bytes to the current tensor; a tensor may arrive
    in many pieces. `close()` checks every byte arrived, fsyncs, renames, and returns the sha256."""

    def __init__(self, path: Path, planned: list[Planned], metadata: dict[str, str] | None = None) -> None:
        self.path, self.tmp = path, path.with_name(path.name + ".tmp")
        header: dict = {"__metadata__": metadata} if metadata else {}
        offset = 0
        for p in planned:
            header[p.name] = {"dtype": p.dtype, "shape": list(p.shape), "data_offsets": [offset, offset + p.nbytes]}
            offset += p.nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # the reference writer pads the header to 8 bytes
        self._order = [(p.name, p.nbytes) for p in planned]
        self._i, self._done = 0, 0  # the tensor being written, and its bytes so far
        self._hash = hashlib.sha256()
        self._fh = self.tmp.open("wb")
        self._emit(struct.pack("<Q", len(blob)) + blob)
        self._advance()

    def _advance(self) -> None:
        while self._i < len(self._order) and self._done == self._order[self._i][1]:
            self._i, self._done = self._i + 1, 0

    def _emit(self, data: bytes | memoryview) -> None:
        self._fh.write(data)
        self._hash.update(data)

    def write(self, name: str, data: bytes | torch.Tensor) -> None:
        if self._i >= len(self._order) or self._order[self._i][0] != name:
            want = self._order[self._i][0] if self._i < len(self._order) else "nothing"
            raise SafetensorsError(f"{self.path.name}: got bytes for {name}, expected {want}")
        if isinstance(data, torch.Tensor):
            data = memoryview(data.contiguous().view(torch.uint8).numpy()).cast("B")
        if self._done + len(data) > self._order[self._i][1]:
            raise SafetensorsError(f"{self.path.name}: {name} overflows its {self._order[self._i][1]} bytes")
        self._emit(data)
        self._done += len(data)
        self._advance()

    def close(self) -> str:
        if self._i < len(self._order):
            raise SafetensorsError(f"{self.path.name}: {self._order[self._i][0]} is incomplete")
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        self.tmp.replace(self.path)
        return self._hash.hexdigest()

    def abort(self) -> None:
        self._fh.close()
        self.tmp.unlink(missing_ok=True)
