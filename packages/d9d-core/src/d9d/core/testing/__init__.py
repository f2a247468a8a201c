"""Test support: run a function on N ranks of a real gloo process group by forking a warmed-up parent.

See `d9d.core.testing.ranks` for the mechanism and `d9d.core.testing.pytest_plugin` for the pytest marker.
"""

from d9d.core.testing.gpus import gpu_world_size
from d9d.core.testing.ranks import RankFailure, RankTimeout, run_on_ranks, warm_up_distributed

__all__ = ["RankFailure", "RankTimeout", "gpu_world_size", "run_on_ranks", "warm_up_distributed"]
