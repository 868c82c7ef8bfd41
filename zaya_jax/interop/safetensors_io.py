"""Read safetensors files without pickle or torch: the header is JSON, the tensors raw little-endian bytes.

The ``safetensors`` package's NumPy backend rejects bfloat16, which ZAYA1 checkpoints use; this
reader maps every dtype through ``ml_dtypes`` and memory-maps the file, so a tensor is only read
when it is converted.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from zaya_jax.files import atomic_file

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
_MAX_HEADER = 100 * 1024 * 1024


class SafetensorsError(ValueError):
    """A file that is not a readable safetensors file."""


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """Map every tensor of one ``.safetensors`` file to a read-only, memory-mapped NumPy array."""
    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) != 8:
            raise SafetensorsError(f"{path}: too short to be a safetensors file")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > min(_MAX_HEADER, size - 8):
            raise SafetensorsError(f"{path}: header length {header_len} is impossible for a {size}-byte file")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise SafetensorsError(f"{path}: header is not JSON ({err})") from None
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len)
    tensors = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(meta.get("dtype"))
        if dtype is None:
            raise SafetensorsError(f"{path}: tensor {name!r} has unsupported dtype {meta.get('dtype')!r}")
        begin, end = meta["data_offsets"]
        shape = tuple(meta["shape"])
        expected = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if end - begin != expected or end > data.size:
            raise SafetensorsError(f"{path}: tensor {name!r} offsets {begin}..{end} do not fit shape {shape}")
        tensors[name] = data[begin:end].view(dtype).reshape(shape)
    return tensors


def safetensors_files(directory: str | Path) -> list[Path]:
    """The weight files of a ``save_pretrained`` directory (single file or sharded with an index)."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        names = sorted(set(weight_map.values()))
        files = [directory / name for name in names]
        for file in files:
            if file.parent.resolve() != directory.resolve():
                raise SafetensorsError(f"{index}: shard {file.name!r} points outside {directory}")
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise SafetensorsError(f"{directory}: shards listed in the index are missing: {missing}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise SafetensorsError(
            f"{directory}: no *.safetensors files (only safetensors is read, never pickle)"
        )
    return files


def read_directory(directory: str | Path) -> dict[str, np.ndarray]:
    """All tensors of a ``save_pretrained`` directory, by name; duplicate names are an error."""
    tensors: dict[str, np.ndarray] = {}
    for file in safetensors_files(directory):
        for name, array in read_safetensors(file).items():
            if name in tensors:
                raise SafetensorsError(f"{directory}: tensor {name!r} appears in more than one shard")
            tensors[name] = array
    return tensors


_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


def write_safetensors(
    path: str | Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None
) -> None:
    """Write tensors (any dtype in the table above, bfloat16 included) as one safetensors file.

    Written to a temporary name and renamed, so a reader never sees a half-written file.
    """
    path = Path(path)
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    arrays = []
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        dtype = _NAMES.get(array.dtype)
        if dtype is None:
            raise SafetensorsError(f"tensor {name!r} has unsupported dtype {array.dtype}")
        header[name] = {
            "dtype": dtype,
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
        arrays.append(array)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    with atomic_file(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for array in arrays:
            f.write(array.tobytes())
