"""Backend selection of the Triton-backed families: explicit > environment > detection (sm90+ with Triton)."""

import pytest

from d9d.kernels import Capabilities
from d9d.kernels.grouped_mm import TritonGroupedMmConfig, resolve_grouped_mm_config
from d9d.kernels.linear_cross_entropy import resolve_linear_cross_entropy_config
from d9d.kernels.moe_permute import resolve_moe_permute_config
from d9d.kernels.rms_norm import EagerRmsNormConfig, resolve_rms_norm_config
from d9d.kernels.rope import resolve_rope_config
from d9d.kernels.swiglu import resolve_swiglu_config

RESOLVERS = {
    "RMS_NORM": resolve_rms_norm_config,
    "SWIGLU": resolve_swiglu_config,
    "ROPE": resolve_rope_config,
    "MOE_PERMUTE": resolve_moe_permute_config,
    "LINEAR_CROSS_ENTROPY": resolve_linear_cross_entropy_config,
}
HOPPER = Capabilities(device_type="cuda", cuda_capability=(9, 0), installed=frozenset({"triton"}))
AMPERE = Capabilities(device_type="cuda", cuda_capability=(8, 0), installed=frozenset({"triton"}))
HOPPER_NO_TRITON = Capabilities(device_type="cuda", cuda_capability=(9, 0))
CPU = Capabilities(device_type="cpu", installed=frozenset({"triton"}))


@pytest.mark.parametrize("family", RESOLVERS)
def test_detection_picks_triton_only_on_hopper_with_triton(family, monkeypatch):
    monkeypatch.delenv(f"D9D_BACKEND_AUTO_{family}", raising=False)
    resolve = RESOLVERS[family]
    assert resolve(capabilities=HOPPER).kind == "triton"
    for capabilities in (AMPERE, HOPPER_NO_TRITON, CPU):
        assert resolve(capabilities=capabilities).kind == "eager"


@pytest.mark.parametrize("family", RESOLVERS)
def test_environment_overrides_detection_and_bad_values_name_the_kinds(family, monkeypatch):
    resolve = RESOLVERS[family]
    monkeypatch.setenv(f"D9D_BACKEND_AUTO_{family}", '{"kind": "eager"}')
    assert resolve(capabilities=HOPPER).kind == "eager"
    monkeypatch.setenv(f"D9D_BACKEND_AUTO_{family}", '{"kind": "cuda"}')
    with pytest.raises(ValueError, match=f"D9D_BACKEND_AUTO_{family}=.*Valid kinds: eager, triton"):
        resolve(capabilities=HOPPER)


def test_explicit_config_wins_and_grouped_mm_triton_is_never_auto_chosen(monkeypatch):
    monkeypatch.setenv("D9D_BACKEND_AUTO_RMS_NORM", '{"kind": "triton"}')
    assert resolve_rms_norm_config(EagerRmsNormConfig(), capabilities=HOPPER).kind == "eager"
    monkeypatch.delenv("D9D_BACKEND_AUTO_GROUPED_MM", raising=False)
    assert resolve_grouped_mm_config(capabilities=HOPPER).kind == "torch"
    assert resolve_grouped_mm_config(TritonGroupedMmConfig(), capabilities=HOPPER).kind == "triton"
