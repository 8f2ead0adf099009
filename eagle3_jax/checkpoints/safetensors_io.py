"""The safetensors format, read and written here: 8-byte header length, JSON header, raw bytes.

Written by hand (not through the ``safetensors`` package) so that bfloat16 and float8 round-trip
through ``ml_dtypes`` without torch, and so a reader maps the file (zero-copy views) and checks
every header entry against the file size before any tensor is touched. Used by the HF
checkpoint loader, the draft head export and the serving-weights cache.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any, Mapping

import ml_dtypes
import numpy as np

from eagle3_jax.errors import Eagle3Error

DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}


class SafetensorsError(Eagle3Error, ValueError):
    """A file that is not valid safetensors (or a tensor it cannot hold); names the file."""


class SafetensorsFile:
    """One memory-mapped ``.safetensors`` file: header parsed and checked, tensors as views."""

    def __init__(self, path: Path):
        self.path = path
        size = path.stat().st_size
        try:
            with open(path, "rb") as f:
                prefix = f.read(8)
                if len(prefix) < 8:
                    raise ValueError("file is shorter than the 8-byte header length")
                (header_len,) = struct.unpack("<Q", prefix)
                if header_len > size - 8:
                    raise ValueError(f"header length {header_len} exceeds the file size {size}")
                header = json.loads(f.read(header_len))
            if not isinstance(header, dict):
                raise ValueError("header is not a JSON object")
        except (ValueError, UnicodeDecodeError) as e:
            raise SafetensorsError(f"{path} is not a valid safetensors file ({e}); "
                                  "re-download or re-save it") from None
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self.data_start = 8 + header_len
        data_size = size - self.data_start
        self.entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            try:
                dtype = np.dtype(DTYPES[info["dtype"]])
                shape = tuple(int(s) for s in info["shape"])
                begin, end = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise SafetensorsError(
                    f"{path}: tensor {name!r} has a malformed header entry {info!r}"
                ) from None
            if end - begin != math.prod(shape) * dtype.itemsize or begin < 0:
                raise SafetensorsError(
                    f"{path}: tensor {name!r} byte range [{begin}, {end}) does not fit its "
                    f"shape {shape} of {info['dtype']}"
                )
            if end > data_size:
                raise SafetensorsError(
                    f"{path} is truncated: tensor {name!r} ends at byte {end} of the data "
                    f"section but the file holds only {data_size}; re-download or re-save it"
                )
            self.entries[name] = (dtype, shape, begin, end)
        self._map: np.memmap | None = None

    def tensor(self, name: str) -> np.ndarray:
        """A read-only zero-copy view of one tensor."""
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        dtype, shape, begin, end = self.entries[name]
        raw = self._map[self.data_start + begin:self.data_start + end]
        return raw.view(dtype).reshape(shape)

    def read_all(self) -> dict[str, np.ndarray]:
        """Every tensor, copied out of the file (views would fault if the file is rewritten in
        place while they live)."""
        return {name: np.array(self.tensor(name)) for name in self.entries}


def write_safetensors(path: str | Path, tensors: Mapping[str, np.ndarray],
                      metadata: Mapping[str, str] | None = None) -> None:
    """Write ``tensors`` to ``path`` atomically (a temporary sibling, then a rename)."""
    path = Path(path)
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset, arrays = 0, []
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        if arr.dtype not in NAMES:
            raise SafetensorsError(f"cannot write tensor {name!r} of dtype {arr.dtype}")
        header[name] = {"dtype": NAMES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        arrays.append(arr)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the format pads the header to 8 bytes
    tmp = path.with_name(f"{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for arr in arrays:
            f.write(memoryview(arr.reshape(-1).view(np.uint8)))
    tmp.replace(path)
