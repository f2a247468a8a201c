"""Every backend of a family that can run on this machine, so a new one (e.g. Triton) is tested by existing tests."""

from d9d.kernels import BackendUnavailable
from d9d.kernels.attention import ATTENTION_CONFIG_ADAPTER, build_attention_backend
from d9d.kernels.grouped_mm import GROUPED_MM_CONFIG_ADAPTER, build_grouped_mm
from d9d.kernels.selection import valid_kinds


def available_attention(device_type: str) -> list:
    found = []
    for kind in valid_kinds(ATTENTION_CONFIG_ADAPTER):
        try:
            backend = build_attention_backend(ATTENTION_CONFIG_ADAPTER.validate_python({"kind": kind}))
        except BackendUnavailable:
            continue
        if kind in ("flash_attn_2", "cudnn") and device_type != "cuda":
            continue
        found.append(backend)
    return found


def available_grouped_mm(device_type: str) -> list:
    found = []
    for kind in valid_kinds(GROUPED_MM_CONFIG_ADAPTER):
        try:
            backend = build_grouped_mm(GROUPED_MM_CONFIG_ADAPTER.validate_python({"kind": kind}))
        except BackendUnavailable:
            continue
        if kind == "grouped_gemm" and device_type != "cuda":
            continue
        found.append(backend)
    return found
