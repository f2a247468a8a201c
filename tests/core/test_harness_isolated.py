"""Harness behaviour that needs a second thread: it runs in the `isolated` pytest invocation, after forking tests."""

import threading

import pytest

from d9d.core.testing import run_on_ranks

pytestmark = pytest.mark.isolated


def test_refuses_to_fork_while_another_thread_runs():
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait, name="background-worker")
    worker.start()
    try:
        with pytest.raises(RuntimeError, match="background-worker"):
            run_on_ranks(2, lambda: None)
    finally:
        stop.set()
        worker.join()
