"""A `DeviceStep` as bytes that hold no code, for the multi-host step channel (engine/distributed.py), whose store
anyone reaching the coordination port can write: MAGIC, the length of a JSON header, the header (the step's structure),
then each array's raw bytes in header order.

Decoding builds only the dataclasses of TYPES (with exactly their fields), arrays of DTYPES and JSON's null, bools,
ints and strs; each array's shape is checked against the bytes left, the header and the nesting are bounded. Anything
else is a StepFormatError, never an object of the sender's choosing. Encoding refuses what decoding would, so a
genuine step never fails on the workers only."""
from __future__ import annotations

import dataclasses
import json
import math
import struct

import numpy as np

from jaxserve.engine.runner import DeviceStep
from jaxserve.engine.sampler import SamplingTensors
from jaxserve.engine.step_inputs import ModelInputs, SamplerInputs, StepInputs
from jaxserve.models.attention import AttentionBatch

MAGIC = b"jaxserve-step/1\n"
HEADER_LEN = struct.Struct("<I")
MAX_HEADER_BYTES = 1 << 20   # a step's header is a few KB
MAX_DEPTH = 8                # DeviceStep > StepInputs > SamplerInputs > SamplingTensors > array: 4 deep
MAX_NDIM = 4
TYPES = {t.__name__: t for t in (DeviceStep, StepInputs, ModelInputs, SamplerInputs, AttentionBatch, SamplingTensors)}
FIELDS = {name: tuple(f.name for f in dataclasses.fields(t)) for name, t in TYPES.items()}
DTYPES = {d.str: d for d in map(np.dtype, (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
                                            np.uint32, np.uint64, np.float16, np.float32, np.float64))}


class StepFormatError(ValueError):
    """Bytes that are not a step this module encoded."""


def encode(step: DeviceStep) -> bytes:
    arrays = []
    header = json.dumps(_tree(step, arrays), separators=(",", ":")).encode()
    if len(header) > MAX_HEADER_BYTES:
        raise TypeError(f"a step's header of {len(header)} bytes is over MAX_HEADER_BYTES")
    return b"".join([MAGIC, HEADER_LEN.pack(len(header)), header, *(a.tobytes() for a in arrays)])


def _tree(value, arrays: list, depth: int = 0):
    if depth > MAX_DEPTH:
        raise TypeError("a step nested deeper than MAX_DEPTH")
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, np.ndarray):
        if value.dtype.str not in DTYPES or value.ndim > MAX_NDIM:
            raise TypeError(f"no step array may be {value.dtype}[{value.shape}]: not in DTYPES, or over MAX_NDIM")
        arrays.append(value)
        return {"array": [value.dtype.str, list(value.shape)]}
    if isinstance(value, tuple):
        return {"tuple": [_tree(v, arrays, depth + 1) for v in value]}
    if TYPES.get(type(value).__name__) is type(value):
        return {"type": type(value).__name__,
                "fields": {f: _tree(getattr(value, f), arrays, depth + 1) for f in FIELDS[type(value).__name__]}}
    raise TypeError(f"a step cannot hold a {type(value).__name__}")


def decode(data: bytes) -> DeviceStep:
    """The step `encode` made of data; StepFormatError for anything else."""
    start = len(MAGIC) + HEADER_LEN.size
    if not data.startswith(MAGIC) or len(data) < start:
        raise StepFormatError(f"not an encoded step (starts {bytes(data[:16])!r})")
    (size,) = HEADER_LEN.unpack_from(data, len(MAGIC))
    if size > min(MAX_HEADER_BYTES, len(data) - start):
        raise StepFormatError(f"header of {size} bytes: over MAX_HEADER_BYTES or past the end")
    try:
        tree = json.loads(data[start:start + size])
    except (ValueError, RecursionError) as e:
        raise StepFormatError(f"header is not JSON: {e}") from None
    arrays = _Arrays(data, start + size)
    step = _build(tree, arrays, 0)
    if type(step) is not DeviceStep:
        raise StepFormatError(f"holds a {type(step).__name__}, not a DeviceStep")
    if arrays.offset != len(data):
        raise StepFormatError(f"{len(data) - arrays.offset} bytes past the last array")
    return step


def _build(node, arrays: _Arrays, depth: int):
    if depth > MAX_DEPTH:
        raise StepFormatError("nested deeper than MAX_DEPTH")
    match node:
        case None | bool() | int() | str():
            return node
        case {"array": [str(dtype), list(shape)]} if len(node) == 1:
            return arrays.take(dtype, shape)
        case {"tuple": list(items)} if len(node) == 1:
            return tuple(_build(v, arrays, depth + 1) for v in items)
        case {"type": str(name), "fields": dict(fields)} if len(node) == 2:
            if name not in TYPES:
                raise StepFormatError(f"unknown type {name[:64]!r}")
            if fields.keys() != set(FIELDS[name]):
                raise StepFormatError(f"{name} with fields {sorted(fields)[:16]}")
            return TYPES[name](**{f: _build(v, arrays, depth + 1) for f, v in fields.items()})
    raise StepFormatError(f"unexpected {type(node).__name__} in the header")


class _Arrays:
    """The arrays after the header, taken in order."""

    def __init__(self, data: bytes, offset: int):
        self.data, self.offset = data, offset

    def take(self, dtype: str, shape: list) -> np.ndarray:
        if dtype not in DTYPES:
            raise StepFormatError(f"array dtype {dtype[:16]!r} is not one of {sorted(DTYPES)}")
        if len(shape) > MAX_NDIM or not all(type(d) is int and d >= 0 for d in shape):
            raise StepFormatError(f"bad array shape {shape[:MAX_NDIM + 1]}")
        count = math.prod(shape)
        if count * DTYPES[dtype].itemsize > len(self.data) - self.offset:
            raise StepFormatError(f"array {dtype}{shape} runs past the end ({len(self.data) - self.offset} bytes left)")
        out = np.frombuffer(self.data, DTYPES[dtype], count, self.offset).reshape(shape).copy()   # owned, aligned
        self.offset += out.nbytes
        return out
