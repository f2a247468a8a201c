"""Pytest plugin: `@pytest.mark.distributed(world_size=N)` runs a test's body on N forked gloo ranks.

Enable it with `-p d9d.core.testing.pytest_plugin` (the repository's pytest configuration does). The test function
itself runs on every rank with the default process group initialised; fixtures are resolved once in the parent
before the fork. `world_size` may also come from a `world_size` parameter of the test (e.g. parametrized). Marked
`gpu` tests are skipped cleanly when no CUDA device is visible.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest
import torch

from d9d.core.testing.ranks import DEFAULT_TIMEOUT_SECONDS, run_on_ranks, warm_up_distributed

_state = {"warmed_up": False}


def pytest_configure(config: pytest.Config) -> None:
    # `torch.cuda.is_available()` normally asks the CUDA driver, which poisons later forks for CUDA use; the NVML-based
    # check answers the same question without that, so GPU tests can still fork ranks that each use a GPU.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    config.addinivalue_line("markers", "distributed(world_size, timeout, init_process_group): run on N gloo ranks")
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped cleanly without one")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run tests that fork ranks before the others (a stable reorder; modules keep their own order).

    With a CUDA build of PyTorch, a process that has run any backward has started autograd's device threads, and
    its forked children can no longer use autograd. Forking first keeps one pytest process enough on GPU machines.
    """
    forks: dict[str, bool] = {}

    def forking(item: pytest.Item) -> bool:
        if item.get_closest_marker("distributed") is not None:
            return True
        path = str(item.path)
        if path not in forks:
            try:
                forks[path] = "run_on_ranks(" in item.path.read_text()
            except OSError:
                forks[path] = False
        return forks[path]

    items.sort(key=lambda item: not forking(item))
    for item in items:
        item.stash[_FORKS] = forking(item)


_FORKS = pytest.StashKey[bool]()


def assert_no_threads_before_forking(item: pytest.Item) -> None:
    """Fail `item` if it left threads running while a later test of the session forks ranks (which refuse to fork
    a multi-threaded process). Once no forking test is left (they run first), threads do no harm: torch.compile's
    worker threads, for one, stay for the life of the process."""
    items = item.session.items
    later = items[items.index(item) + 1 :] if item in items else []
    if not any(other.stash.get(_FORKS, False) for other in later):
        return
    others = [thread.name for thread in threading.enumerate() if thread is not threading.main_thread()]
    assert not others, f"this test left threads running ({others}); later forking tests would refuse to fork"


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; none is visible")
    if item.get_closest_marker("distributed") is not None:
        _warm_up_once()


def _warm_up_once() -> None:
    # Counted in the first distributed test's setup, not in its call, so call durations show the test itself.
    if not _state["warmed_up"]:
        warm_up_distributed()
        _state["warmed_up"] = True


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    marker = pyfuncitem.get_closest_marker("distributed")
    arguments: dict[str, Any] = {
        name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames if name in pyfuncitem.funcargs
    }
    function = pyfuncitem.obj
    if marker is None:
        return None
    _warm_up_once()
    world_size = marker.kwargs.get("world_size", marker.args[0] if marker.args else arguments.get("world_size"))
    if not isinstance(world_size, int):
        raise pytest.UsageError(
            f"{pyfuncitem.nodeid}: @pytest.mark.distributed needs world_size=N or a `world_size` test parameter"
        )
    run_on_ranks(
        world_size,
        lambda: function(**arguments),
        timeout_seconds=float(marker.kwargs.get("timeout", DEFAULT_TIMEOUT_SECONDS)),
        init_process_group=bool(marker.kwargs.get("init_process_group", True)),
    )
    return True
