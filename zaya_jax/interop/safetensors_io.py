"""Safetensors directories through the ``safetensors`` library (NumPy API; importing ``ml_dtypes``
gives NumPy the bfloat16 that ZAYA1 checkpoints use). Never pickle.

Reading takes a single ``model.safetensors`` or the shards named by ``model.safetensors.index.json``
(which may not point outside the directory). Writing splits the tensors into shards of at most
``max_shard_bytes`` with an index, as ``save_pretrained`` does, each shard written under a temporary
name and renamed, so a reader never sees a half-written file.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import ml_dtypes  # registers bfloat16 with NumPy for safetensors.numpy; float8 (_ML_DTYPES)
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from zaya_jax.files import read_json, write_atomic

INDEX = "model.safetensors.index.json"
SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size ("5GB")


class SafetensorsError(ValueError):
    """A file that is not a readable safetensors file, or a directory without one."""


# safetensors' NumPy API looks its dtypes up in ``numpy``, which has no float8: tensors of these
# types are read here from the file's header and bytes, as ml_dtypes' types.
_ML_DTYPES = {
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "F8_E8M0": ml_dtypes.float8_e8m0fnu,
}


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of one ``.safetensors`` file as a NumPy array (float8 as ml_dtypes' types)."""
    try:
        with safe_open(str(path), framework="numpy") as f:
            codes = {name: f.get_slice(name).get_dtype() for name in f.keys()}  # noqa: SIM118
            return {
                name: _read_ml_dtype(path, name) if code in _ML_DTYPES else f.get_tensor(name)
                for name, code in codes.items()
            }
    except (SafetensorError, OSError, ValueError) as err:
        raise SafetensorsError(f"{path}: not a readable safetensors file ({err})") from None


def _read_ml_dtype(path: str | Path, name: str) -> np.ndarray:
    """One tensor of an ``_ML_DTYPES`` type, read at the offsets the file's header gives (safe_open
    has checked the header and the offsets already)."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        entry = json.loads(f.read(size))[name]
        start, end = entry["data_offsets"]
        f.seek(8 + size + start)
        data = np.frombuffer(f.read(end - start), np.uint8)
    return data.view(_ML_DTYPES[entry["dtype"]]).reshape(entry["shape"])


def tensor_shapes(directory: str | Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """(shape, dtype) of every tensor of a directory, from the headers only (no tensor is read)."""
    out = {}
    for file in safetensors_files(directory):
        try:
            with safe_open(str(file), framework="numpy") as f:
                for name in f.keys():  # noqa: SIM118
                    piece = f.get_slice(name)
                    out[name] = (tuple(piece.get_shape()), _dtype_name(piece.get_dtype()))
        except (SafetensorError, OSError) as err:
            raise SafetensorsError(f"{file}: not a readable safetensors file ({err})") from None
    return out


def _dtype_name(code: str) -> str:
    names = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64", "U8": "uint8"}
    return names.get(code) or (np.dtype(_ML_DTYPES[code]).name if code in _ML_DTYPES else code.lower())


def safetensors_files(directory: str | Path) -> list[Path]:
    """The weight files of a ``save_pretrained`` directory (single file or sharded with an index)."""
    directory = Path(directory)
    index = directory / INDEX
    if index.is_file():
        fix = "restore it from a copy, or delete it to read every *.safetensors file of the directory"
        weight_map = read_json(index, "the shard index", fix).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise SafetensorsError(f"{index}: weight_map is not an object of tensor -> file names; {fix}")
        files = [directory / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if file.parent.resolve() != directory.resolve():
                raise SafetensorsError(f"{index}: shard {file.name!r} points outside {directory}; {fix}")
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise SafetensorsError(
                f"shards listed in {index} are missing: {', '.join(missing)}; restore them from a copy"
            )
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise SafetensorsError(
            f"{directory / 'model.safetensors'} is missing ({directory} has no *.safetensors files and no "
            f"{INDEX}; only safetensors is read, never pickle)"
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


def write_directory(
    directory: str | Path, tensors: dict[str, np.ndarray], max_shard_bytes: int = SHARD_BYTES
) -> list[Path]:
    """Write ``tensors`` (name order) as ``model.safetensors``, or as ``model-0000i-of-0000n.safetensors``
    shards of at most ``max_shard_bytes`` (a larger tensor gets a shard of its own) plus
    ``model.safetensors.index.json``. Returns the files written."""
    directory = Path(directory)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        if shards[-1] and size + array.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = array
        size += array.nbytes
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    )
    for name, shard in zip(names, shards, strict=True):
        tmp = directory / (name + ".tmp")
        save_file(shard, str(tmp), metadata={"format": "pt"})
        with tmp.open("rb") as f:  # on disk before its name is (write_atomic does the same)
            os.fsync(f.fileno())
        os.replace(tmp, directory / name)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(a.nbytes for a in tensors.values())},
            "weight_map": {
                tensor: name for name, shard in zip(names, shards, strict=True) for tensor in shard
            },
        }
        write_atomic(directory / INDEX, json.dumps(index, indent=2) + "\n")
    return [directory / name for name in names]
