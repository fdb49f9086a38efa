"""safetensors files: the header checked against the file, tensors read by chunks on threads or mapped in place,
and written (the weights `prepared` keeps)."""
from __future__ import annotations

import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxserve.models.errors import ModelLoadError

SAFETENSORS_DTYPES = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32, "F64": np.float64,
                      "F8_E4M3": ml_dtypes.float8_e4m3fn, "I64": np.int64, "I32": np.int32, "U8": np.uint8,
                      "BOOL": np.bool_}
MAX_HEADER_BYTES = 100 << 20   # the format's own limit
READ_CHUNK, READ_THREADS = 16 << 20, 8   # a tensor's bytes are read in chunks on threads
SAFETENSORS_NAMES = {np.dtype(v): k for k, v in SAFETENSORS_DTYPES.items()}


@dataclass(slots=True)
class StoredTensor:
    name: str
    dtype: np.dtype
    shape: tuple
    offset: int   # of its first byte in the file

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def safetensors_header(path: Path) -> list[StoredTensor]:
    """The file's tensors, in file order, checked against the file's size."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < length <= min(MAX_HEADER_BYTES, size - 8):
            raise ModelLoadError(path, f"corrupt safetensors file (header length {length}, file {size} bytes)")
        try:
            header = json.loads(f.read(length))
            header.pop("__metadata__", None)
            entries = []
            for name, meta in header.items():
                begin, end = map(int, meta["data_offsets"])
                entries.append((begin, end, name, meta["dtype"], tuple(map(int, meta["shape"]))))
            entries.sort()
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(path, f"corrupt safetensors file (header: {e!r})") from e
    tensors = []
    for begin, end, name, dtype, shape in entries:
        if dtype not in SAFETENSORS_DTYPES:
            raise ModelLoadError(path, f"tensor {name} has dtype {dtype}; supported: {', '.join(SAFETENSORS_DTYPES)}")
        t = StoredTensor(name, np.dtype(SAFETENSORS_DTYPES[dtype]), shape, 8 + length + begin)
        if end - begin != t.nbytes or t.offset + t.nbytes > size:
            raise ModelLoadError(path, f"corrupt safetensors file (tensor {name}: bytes {begin}..{end} do not hold "
                                       f"{dtype}{list(shape)} inside {size} bytes)")
        tensors.append(t)
    return tensors


def read_tensor(f, t: StoredTensor, pool: ThreadPoolExecutor) -> np.ndarray:
    """t's bytes, READ_CHUNK at a time on the pool's threads (preads: the GIL released)."""
    buf = np.empty(t.nbytes, np.uint8)
    view = memoryview(buf)

    def read_chunk(start: int) -> None:
        end = min(start + READ_CHUNK, t.nbytes)
        while start < end:
            n = os.preadv(f.fileno(), [view[start:end]], t.offset + start)
            if n == 0:
                raise ModelLoadError(f.name, "corrupt safetensors file (shorter than its header says)")
            start += n
    list(pool.map(read_chunk, range(0, t.nbytes, READ_CHUNK)))
    return buf.view(t.dtype).reshape(t.shape)


def read_safetensors(files: list[Path]):
    """(name, array, shape, bytes) of every tensor, read here in file order, each by chunks on a few threads (the
    pool places earlier tensors meanwhile). Not the safetensors package: its slices copy from a memory map under the
    GIL, page fault by page fault, far below what the disk and the page cache deliver; chunked preads on threads
    come close to both."""
    with ThreadPoolExecutor(READ_THREADS) as pool:
        for path in files:
            with open(path, "rb", buffering=0) as f:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
                for t in safetensors_header(path):
                    yield t.name, read_tensor(f, t, pool), t.shape, t.nbytes


def map_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of the file as a read-only view of its memory map: pages are read when a view is."""
    mapped = np.memmap(path, np.uint8, mode="r")
    return {t.name: np.ndarray(t.shape, t.dtype, mapped, t.offset) for t in safetensors_header(path)}


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """tensors (numpy arrays of SAFETENSORS_DTYPES) as one file, those of the widest elements first: the format
    allows no gaps between tensors, so this order keeps each aligned to its element size in a memory map."""
    ordered = sorted(tensors.items(), key=lambda item: -item[1].dtype.itemsize)
    header, offset = {}, 0
    for name, a in ordered:
        header[name] = {"dtype": SAFETENSORS_NAMES[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little") + encoded)
        for _, a in ordered:
            f.write(np.ascontiguousarray(a).tobytes())
