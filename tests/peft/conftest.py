"""PEFT tests fork gloo ranks and use transformers/peft in-process: keep the pytest process single-threaded."""

import os

import pytest
import tqdm

from d9d.core.testing.pytest_plugin import assert_no_threads_before_forking

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
tqdm.tqdm.monitor_interval = 0  # no tqdm_monitor thread


@pytest.fixture(autouse=True)
def _leaves_no_threads(request: pytest.FixtureRequest):
    yield
    assert_no_threads_before_forking(request.node)
