"""Kernel families behind swappable backends, each with a plain-PyTorch reference.

Every family (attention, grouped matmul) has a `Protocol` the blocks call, a closed pydantic union of backend
configs discriminated by `kind`, and a `build_*` function with an exhaustive match. Selection precedence: explicit
config > `D9D_BACKEND_AUTO_<FAMILY>` (JSON) > capability detection. See docs/kernels.md.
"""

from d9d.kernels.capability import Capabilities, detect_capabilities
from d9d.kernels.errors import BackendUnavailable
from d9d.kernels.selection import env_variable, resolve_backend_config

__all__ = ["BackendUnavailable", "Capabilities", "detect_capabilities", "env_variable", "resolve_backend_config"]
