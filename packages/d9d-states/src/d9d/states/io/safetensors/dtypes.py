"""The dtype names of the safetensors format and their torch dtypes."""

from __future__ import annotations

import torch

TORCH_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "U16": torch.uint16,
    "I16": torch.int16,
    "U32": torch.uint32,
    "I32": torch.int32,
    "U64": torch.uint64,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "C64": torch.complex64,
}
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {dtype: name for name, dtype in TORCH_DTYPES.items()}


def safetensors_dtype(dtype: torch.dtype, *, tensor: str) -> str:
    try:
        return SAFETENSORS_DTYPES[dtype]
    except KeyError:
        supported = ", ".join(str(d).removeprefix("torch.") for d in SAFETENSORS_DTYPES)
        raise ValueError(f"tensor {tensor!r} has dtype {dtype}, which safetensors cannot store ({supported})") from None
