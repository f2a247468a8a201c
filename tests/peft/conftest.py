"""PEFT tests fork gloo ranks and use transformers/peft in-process: keep the pytest process single-threaded."""

import os
import threading

import pytest
import tqdm

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
tqdm.tqdm.monitor_interval = 0  # no tqdm_monitor thread


@pytest.fixture(autouse=True)
def _leaves_no_threads():
    yield
    others = [thread.name for thread in threading.enumerate() if thread is not threading.main_thread()]
    assert not others, f"this test left threads running ({others}); later forking tests would refuse to fork"
