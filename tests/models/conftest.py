"""Model tests are single-process except the parallel plans; transformers is a test-only dependency.

The pytest process must stay single-threaded: the forking multi-rank tests (here and in every later test directory)
refuse to fork while other threads run. transformers' progress bars would start tqdm's monitor thread, so it is
turned off, and every test here checks that it left no thread behind.
"""

import os
from pathlib import Path

import pytest
import tqdm

from d9d.core.testing.pytest_plugin import assert_no_threads_before_forking

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
tqdm.tqdm.monitor_interval = 0  # no tqdm_monitor thread
if not Path("/dev/nvidia0").exists():
    # Triton kernels run in Triton's CPU interpreter here (test_triton_blocks.py). Triton reads this when its
    # language module is first imported, which building a transformers model does: so it is set before any test.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch._dynamo  # noqa: E402, F401  (warm the parent once: forked ranks would otherwise each import it)


@pytest.fixture(autouse=True)
def _leaves_no_threads(request: pytest.FixtureRequest):
    yield
    assert_no_threads_before_forking(request.node)
