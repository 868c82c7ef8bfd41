"""Experts stored quantized, weight-only, in the compressed-tensors format (``quant_method:
"compressed-tensors"`` in config.json), as Zyphra ships ``ZAYA1-8B-FP8-Experts`` and
``ZAYA1-8B-MXFP4-Experts``; every tensor outside the experts stays as it is.

Writing (:func:`compress_experts`) goes through the ``compressed-tensors`` library itself: its
``calculate_qparams`` / ``compute_dynamic_scales_and_zp`` make the scales, its registered compressor
(``float-quantized``, ``mxfp4-pack-quantized``) the stored tensors, its ``QuantizationConfig`` the
``quantization_config``. The library takes two-dimensional weights, so each layer's stacked
``(E, out, in)`` experts go through it as one ``(E * out, in)`` matrix (every scale is per output
row or per group of a row, so this is the same as compressing each expert on its own).

The tensor names follow the stacked layout transformers' ``ZayaForCausalLM`` holds (and, by the one
account of Zyphra's FP8 release found, the release uses): per layer

* FP8 (float8 e4m3, a float32 scale per output channel): ``mlp.experts.gate_up_proj`` (E, 2I, H)
  and ``mlp.experts.gate_up_proj.weight_scale`` (E, 2I, 1), the same for ``down_proj`` (E, H, I);
* MXFP4 (e2m1 packed two to a byte, low nibble first; a uint8 E8M0 exponent per 32 inputs):
  ``mlp.experts.gate_up_proj.weight_packed`` (E, 2I, H/2) and ``...weight_scale`` (E, 2I, H/32).

Reading (:func:`dequantize_experts`) needs neither torch nor compressed-tensors: NumPy (float8 from
ml_dtypes) computes what compressed-tensors' ``decompress`` does (the FP8 code times its scale in the
scale's dtype; the e2m1 value times ``2 ** (e - 127)``), checking every tensor's dtype, shape and
scale first, so a damaged file is one line naming its tensor. The arithmetic is
:mod:`zaya_jax.ops.quantization`'s, which the model applies for ``model.expert_quantization``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

from zaya_jax.interop.hf.weights import ConversionError, format_names
from zaya_jax.ops.quantization import E8M0_BIAS, MX_GROUP

EXPERT_NAMES = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
KINDS = {"fp8-experts": "fp8", "mxfp4-experts": "mxfp4"}  # --quantize -> model.expert_quantization
FORMATS = {"fp8": "float-quantized", "mxfp4": "mxfp4-pack-quantized"}  # compressed-tensors' formats
TARGETS = ["re:.*experts.*"]  # the modules quantized: the experts (transformers finds them by this)
IGNORE = ["re:^(?!.*experts).*$"]  # every other module, as Zyphra's MXFP4 release lists it
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
_SUFFIXES = (".weight_scale", ".weight_packed", ".weight_zero_point", ".weight_global_scale", ".weight_shape")


def is_expert(name: str) -> bool:
    return name.endswith(EXPERT_NAMES)


# ---- writing (compressed-tensors) ----


def _library() -> Any:
    try:
        import compressed_tensors  # noqa: F401
        import torch  # noqa: F401
    except ImportError:
        raise ConversionError(
            "quantized exports are written by the compressed-tensors library: pip install "
            "'zaya-jax[quantize]' (compressed-tensors and torch)"
        ) from None
    import compressed_tensors.quantization as quantization

    return quantization


def _scheme(expert_quantization: str) -> Any:
    quantization = _library()
    if expert_quantization == "mxfp4":
        return quantization.preset_name_to_scheme("MXFP4A16", TARGETS)
    weights = quantization.QuantizationArgs(
        num_bits=8, type="float", strategy="channel", symmetric=True, dynamic=False
    )
    return quantization.QuantizationScheme(targets=TARGETS, weights=weights)


def quantization_config(expert_quantization: str) -> dict[str, Any]:
    """config.json's ``quantization_config`` for experts quantized as ``expert_quantization``."""
    quantization = _library()
    config = quantization.QuantizationConfig(
        config_groups={"group_0": _scheme(expert_quantization)},
        format=FORMATS[expert_quantization],
        quantization_status="compressed",
        ignore=IGNORE,
    )
    return config.to_dict()


def compress_experts(tensors: Mapping[str, np.ndarray], expert_quantization: str) -> dict[str, np.ndarray]:
    """An HF state dict with every layer's experts (float) replaced by their compressed tensors."""
    quantization = _library()
    import torch
    from compressed_tensors.compressors import BaseCompressor

    scheme = _scheme(expert_quantization)
    compressor = BaseCompressor.get_value_from_registry(FORMATS[expert_quantization])
    out = {name: value for name, value in tensors.items() if not is_expert(name)}
    for name in sorted(filter(is_expert, tensors)):
        experts, rows, inputs = tensors[name].shape
        weight = torch.from_numpy(np.ascontiguousarray(tensors[name], np.float32)).reshape(-1, inputs)
        if expert_quantization == "fp8":
            amax = weight.abs().amax(dim=1, keepdim=True)
            scale, _ = quantization.utils.calculate_qparams(-amax, amax, scheme.weights)
        else:
            scale, _ = quantization.utils.compute_dynamic_scales_and_zp(weight, scheme.weights, module=None)
        for local, value in compressor.compress({"weight": weight, "weight_scale": scale}, scheme).items():
            key = name if local == "weight" else f"{name}.{local}"
            out[key] = _numpy(value).reshape(experts, rows, -1)
    return out


def _numpy(tensor: Any) -> np.ndarray:
    import torch

    if tensor.dtype == torch.float8_e4m3fn:
        return tensor.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    return tensor.numpy()


# ---- reading (NumPy) ----


def expert_quantization_of(config: Mapping[str, Any], path: Any) -> str:
    """The ``model.expert_quantization`` a config.json's ``quantization_config`` stores ("none"
    without one); anything but weight-only FP8 per channel or MXFP4 on the experts is refused."""
    quant = config.get("quantization_config")
    if quant is None:
        return "none"
    where = f"{path}: quantization_config"
    if not isinstance(quant, Mapping):
        raise ConversionError(f"{where} is {quant!r}, not an object")
    if quant.get("quant_method") != "compressed-tensors":
        method = quant.get("quant_method")
        raise ConversionError(f"{where} has quant_method {method!r}; zaya reads 'compressed-tensors' only")
    groups = quant.get("config_groups")
    if not isinstance(groups, Mapping) or len(groups) != 1:
        raise ConversionError(f"{where} must have one config group (the experts'), not {groups!r}")
    (group,) = groups.values()
    weights = group.get("weights") if isinstance(group, Mapping) else None
    if not isinstance(weights, Mapping) or group.get("input_activations") is not None:
        raise ConversionError(
            f"{where}: zaya reads weight-only quantization (a 'weights' entry, no input_activations)"
        )
    targets = group.get("targets")
    if not isinstance(targets, list) or not any("experts" in str(t) for t in targets):
        raise ConversionError(f"{where}: the group's targets {targets!r} are not a list naming the experts")
    found = (weights.get("num_bits"), weights.get("type"), weights.get("strategy"), weights.get("group_size"))
    kind = {(8, "float", "channel", None): "fp8", (4, "float", "group", MX_GROUP): "mxfp4"}.get(found)
    stored_format = group.get("format") or quant.get("format")
    formats = {"fp8": ("float-quantized", "naive-quantized"), "mxfp4": (FORMATS["mxfp4"],)}
    if kind is not None and stored_format in formats[kind]:
        return kind
    if kind is not None:
        raise ConversionError(
            f"{where}: format {stored_format!r} does not store {kind} weights ({' or '.join(formats[kind])})"
        )
    raise ConversionError(
        f"{where}: weights of {found[0]} bits, type {found[1]}, strategy {found[2]}, group_size {found[3]}; "
        "zaya reads 8-bit float per channel (fp8-experts) and 4-bit float in groups of 32 (mxfp4-experts)"
    )


def computed_quantization(stored: str, dtypes: Mapping[str, str]) -> str:
    """The ``model.expert_quantization`` that computes what a directory stores as ``stored``, given
    its tensors' dtypes (names -> dtype names): the same, except for FP8 with scales narrower than
    float32 (llm-compressor writes bfloat16 ones for a bfloat16 model). Those experts dequantize in
    the scale's dtype, and quantizing them again with float32 scales would move most of them, so
    the model computes with them as they are (``none``)."""
    scales = [dtype for name, dtype in dtypes.items() if name.endswith(".weight_scale")]
    if stored == "fp8" and any(dtype != "float32" for dtype in scales):
        return "none"
    return stored


def check_unquantized(tensors: Mapping[str, np.ndarray], path: Any) -> None:
    """A directory without ``quantization_config`` holds no quantized tensor."""
    stray = [n for n, v in tensors.items() if n.endswith(_SUFFIXES) or v.dtype.itemsize == 1]
    if stray:
        raise ConversionError(
            f"{path}: config.json has no quantization_config, but {format_names(sorted(stray))} are "
            "quantized tensors; restore the config.json that came with these weights"
        )


def dequantize_experts(
    tensors: Mapping[str, np.ndarray], expert_quantization: str, path: Any
) -> dict[str, np.ndarray]:
    """The state dict with every layer's compressed experts as float32 (E, out, in) tensors, as
    compressed-tensors' ``decompress`` gives them; tensors outside the experts pass through."""
    base = sorted({_base(n) for n in tensors if _base(n) is not None})
    out = {n: v for n, v in tensors.items() if _base(n) is None}
    for name in base:
        parts = {n.removeprefix(name): v for n, v in tensors.items() if _base(n) == name}
        if expert_quantization == "fp8":
            out[name] = _fp8(name, parts, path)
        else:
            out[name] = _mxfp4(name, parts, path)
    return out


def _base(name: str) -> str | None:
    """The expert weight a stored tensor belongs to (None: not an expert tensor)."""
    for expert in EXPERT_NAMES:
        head, found, tail = name.partition(expert)
        if found and (tail == "" or tail in _SUFFIXES):
            return head + expert
    return None


def _expect(name: str, parts: Mapping[str, np.ndarray], wanted: tuple[str, ...], path: Any) -> None:
    if sorted(parts) != sorted(wanted):
        have = ", ".join(name + p for p in sorted(parts)) or "nothing"
        need = ", ".join(name + p for p in wanted)
        raise ConversionError(f"{path}: {name} is stored as {have}; its format needs {need}")


def _fp8(name: str, parts: Mapping[str, np.ndarray], path: Any) -> np.ndarray:
    _expect(name, parts, ("", ".weight_scale"), path)
    codes, scale = parts[""], parts[".weight_scale"]
    if codes.dtype != ml_dtypes.float8_e4m3fn or codes.ndim != 3:
        raise ConversionError(
            f"{path}: {name} is {codes.dtype} {list(codes.shape)}; fp8-experts stores float8_e4m3fn (E, out, in)"
        )
    _check_scale(name, scale, (*codes.shape[:2], 1), ("float32", "bfloat16", "float16"), path)
    if not np.all(np.isfinite(scale.astype(np.float32))) or not np.all(scale.astype(np.float32) > 0):
        raise ConversionError(f"{path}: {name}.weight_scale holds values that are not finite and > 0")
    # compressed-tensors: the code times its scale, in the scale's dtype
    return (codes.astype(scale.dtype) * scale).astype(np.float32)


def _mxfp4(name: str, parts: Mapping[str, np.ndarray], path: Any) -> np.ndarray:
    _expect(name, parts, (".weight_packed", ".weight_scale"), path)
    packed, exponents = parts[".weight_packed"], parts[".weight_scale"]
    if packed.dtype != np.uint8 or packed.ndim != 3:
        raise ConversionError(
            f"{path}: {name}.weight_packed is {packed.dtype} {list(packed.shape)}; mxfp4-experts stores "
            "uint8 (E, out, in / 2)"
        )
    inputs = packed.shape[2] * 2
    if inputs % MX_GROUP:
        raise ConversionError(f"{path}: {name} has {inputs} inputs, not a multiple of {MX_GROUP}")
    _check_scale(name, exponents, (*packed.shape[:2], inputs // MX_GROUP), ("uint8",), path)
    if np.any(exponents == 255):
        raise ConversionError(f"{path}: {name}.weight_scale holds 255, E8M0's NaN")
    values = E2M1_VALUES[np.stack([packed & 0x0F, packed >> 4], axis=-1)].reshape(*packed.shape[:2], -1)
    scales = np.exp2(exponents.astype(np.float32) - E8M0_BIAS)
    return values * np.repeat(scales, MX_GROUP, axis=-1)


def _check_scale(
    name: str, scale: np.ndarray, shape: tuple[int, ...], dtypes: tuple[str, ...], path: Any
) -> None:
    if tuple(scale.shape) != shape or scale.dtype.name not in dtypes:
        raise ConversionError(
            f"{path}: {name}.weight_scale is {scale.dtype} {list(scale.shape)}; its weight needs "
            f"{' or '.join(dtypes)} {list(shape)}"
        )


def export_bytes(cfg: Any, expert_quantization: str = "none", dtype: str = "bfloat16") -> dict[str, int]:
    """The bytes of the tensors ``save_hf_directory`` writes for ``cfg`` (every file's tensors;
    headers aside), from the shapes alone: ``{"experts", "rest", "total"}``. Every tensor is in
    ``dtype`` but the balancing biases (float32) and the experts, which a quantized export stores as
    1-byte FP8 codes plus a float32 scale per output row, or 4-bit MXFP4 codes plus a byte per 32."""
    from zaya_jax.model import BALANCING, abstract_variables

    variables = abstract_variables(cfg)
    expert_shapes = [variables["params"]["layers"]["experts"][name].shape for name in ("wi", "wo")]
    expert_values = sum(int(np.prod(shape)) for shape in expert_shapes)
    rows = sum(int(np.prod(shape)) // shape[2] for shape in expert_shapes)  # (layers, experts, in, out)
    values = sum(int(np.prod(leaf.shape)) for leaf in _leaves(variables["params"]))
    balancing = sum(int(np.prod(leaf.shape)) for leaf in _leaves(variables[BALANCING]))
    width = 4 if dtype == "float32" else 2
    experts = {
        "none": expert_values * width,
        "fp8": expert_values + 4 * rows,
        "mxfp4": expert_values // 2 + expert_values // MX_GROUP,
    }[expert_quantization]
    rest = (values - expert_values) * width + 4 * balancing
    return {"experts": experts, "rest": rest, "total": experts + rest}


def _leaves(tree: Any) -> list[Any]:
    import jax

    return jax.tree.leaves(tree)
