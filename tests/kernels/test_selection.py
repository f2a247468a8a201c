"""Backend selection: explicit config > D9D_BACKEND_AUTO_<FAMILY> > capability detection, for every family."""

import pytest

from d9d.kernels import BackendUnavailable, Capabilities, detect_capabilities, env_variable
from d9d.kernels.attention import (
    EagerAttentionConfig,
    FlashAttention2Config,
    SdpaAttentionConfig,
    build_attention_backend,
    resolve_attention_config,
)
from d9d.kernels.grouped_mm import (
    EagerGroupedMmConfig,
    GroupedGemmConfig,
    TorchGroupedMmConfig,
    build_grouped_mm,
    detect_grouped_mm_config,
    resolve_grouped_mm_config,
)

CPU = Capabilities(device_type="cpu")
H100 = Capabilities(device_type="cuda", cuda_capability=(9, 0))
A100 = Capabilities(device_type="cuda", cuda_capability=(8, 0))
A100_WITH_GG = Capabilities(device_type="cuda", cuda_capability=(8, 0), installed=frozenset({"grouped_gemm"}))


def test_env_variable_names_follow_the_family():
    assert env_variable("attention") == "D9D_BACKEND_AUTO_ATTENTION"
    assert env_variable("grouped_mm") == "D9D_BACKEND_AUTO_GROUPED_MM"


def test_explicit_config_wins_over_environment(monkeypatch):
    monkeypatch.setenv("D9D_BACKEND_AUTO_ATTENTION", '{"kind": "eager"}')
    assert resolve_attention_config(SdpaAttentionConfig(), capabilities=CPU) == SdpaAttentionConfig()
    monkeypatch.setenv("D9D_BACKEND_AUTO_GROUPED_MM", '{"kind": "eager"}')
    assert resolve_grouped_mm_config(TorchGroupedMmConfig(), capabilities=H100) == TorchGroupedMmConfig()


def test_environment_wins_over_detection(monkeypatch):
    monkeypatch.setenv("D9D_BACKEND_AUTO_ATTENTION", '{"kind": "eager"}')
    assert resolve_attention_config(capabilities=CPU) == EagerAttentionConfig()
    assert build_attention_backend().name == "eager"
    monkeypatch.setenv("D9D_BACKEND_AUTO_GROUPED_MM", '{"kind": "torch"}')
    assert resolve_grouped_mm_config(capabilities=CPU) == TorchGroupedMmConfig()
    assert build_grouped_mm().name == "torch"


def test_detection_without_environment(monkeypatch):
    monkeypatch.delenv("D9D_BACKEND_AUTO_ATTENTION", raising=False)
    monkeypatch.delenv("D9D_BACKEND_AUTO_GROUPED_MM", raising=False)
    assert resolve_attention_config(capabilities=H100) == SdpaAttentionConfig()
    assert resolve_grouped_mm_config(capabilities=CPU) == EagerGroupedMmConfig()
    assert build_grouped_mm(capabilities=H100).name == "torch"


@pytest.mark.parametrize(
    ("capabilities", "expected"),
    [
        (CPU, EagerGroupedMmConfig()),
        (H100, TorchGroupedMmConfig()),
        (A100, EagerGroupedMmConfig()),
        (A100_WITH_GG, GroupedGemmConfig()),
    ],
    ids=["cpu", "sm90", "sm80", "sm80-grouped-gemm"],
)
def test_grouped_mm_detection_by_architecture(capabilities, expected):
    assert detect_grouped_mm_config(capabilities) == expected


def test_invalid_environment_names_the_variable_and_valid_kinds(monkeypatch):
    monkeypatch.setenv("D9D_BACKEND_AUTO_GROUPED_MM", '{"kind": "cutlass"}')
    with pytest.raises(ValueError, match=r"D9D_BACKEND_AUTO_GROUPED_MM=.*Valid kinds: eager, grouped_gemm, torch"):
        resolve_grouped_mm_config(capabilities=CPU)
    monkeypatch.setenv("D9D_BACKEND_AUTO_ATTENTION", "not json")
    with pytest.raises(ValueError, match=r"D9D_BACKEND_AUTO_ATTENTION.*cudnn, eager, flash_attn_2, flex, sdpa"):
        resolve_attention_config(capabilities=CPU)


def test_empty_environment_variable_falls_back_to_detection(monkeypatch):
    monkeypatch.setenv("D9D_BACKEND_AUTO_ATTENTION", "  ")
    assert resolve_attention_config(capabilities=CPU) == SdpaAttentionConfig()


def test_extra_keys_in_configs_are_rejected(monkeypatch):
    monkeypatch.setenv("D9D_BACKEND_AUTO_ATTENTION", '{"kind": "sdpa", "tile": 64}')
    with pytest.raises(ValueError, match="D9D_BACKEND_AUTO_ATTENTION"):
        resolve_attention_config(capabilities=CPU)


@pytest.mark.skipif("flash_attn" in detect_capabilities().installed, reason="flash_attn is installed here")
def test_choosing_missing_flash_attention_is_a_clear_error():
    with pytest.raises(BackendUnavailable, match=r"flash_attn package.*pip install d9d-kernels\[flash-attn\]"):
        build_attention_backend(FlashAttention2Config())


@pytest.mark.skipif("grouped_gemm" in detect_capabilities().installed, reason="grouped_gemm is installed here")
def test_choosing_missing_grouped_gemm_is_a_clear_error():
    with pytest.raises(BackendUnavailable, match=r"grouped_gemm package.*pip install d9d-kernels\[grouped-gemm\]"):
        build_grouped_mm(GroupedGemmConfig())


def test_capabilities_of_this_machine_list_only_optional_packages():
    capabilities = detect_capabilities("cpu")
    assert capabilities.device_type == "cpu"
    assert capabilities.cuda_capability is None
    assert capabilities.installed <= {"flash_attn", "grouped_gemm", "triton"}
