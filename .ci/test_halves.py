"""Run the test suite's two pytest invocations side by side: `-m "not isolated"` and `-m isolated`.

Usage: python .ci/test_halves.py [--one-after-the-other] [PYTEST_ARGS ...]   (PYTEST_ARGS go to both)

They must be separate processes (forking tests refuse a pytest process with threads; isolated tests start them), but
nothing orders them: they share no files or ports (each has its own `--basetemp`; ports are asked of the OS). On a
2-core machine neither keeps both cores busy (single-threaded imports, the Prefect API's start-up, subprocess
launches), so running them together finishes sooner than one after the other (docs/benchmarks.md, "CI wall time").
Each line of output is prefixed with its half; each half's `--durations` table and summary come at its end. The
exit status is the first non-zero one of the two (both always run to the end).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO

HALVES = {"forking": "not isolated", "isolated": "isolated"}


def _relay(name: str, stream: IO[bytes], lock: threading.Lock) -> None:
    """Copy a half's output to this process's stdout line by line, prefixed, never mixing two halves' lines."""
    out = sys.stdout.buffer
    for line in iter(stream.readline, b""):
        with lock:
            out.write(f"[{name}] ".encode() + line)
            out.flush()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )  # every other argument is pytest's, abbreviations of this one included
    parser.add_argument("--one-after-the-other", action="store_true", help="the old order (to compare wall times)")
    args, pytest_args = parser.parse_known_args()
    base = Path(os.environ.get("TOX_ENV_DIR") or tempfile.gettempdir()) / "tmp" / "test-halves"
    base.mkdir(parents=True, exist_ok=True)  # pytest makes `--basetemp` itself, not its parents
    lock = threading.Lock()
    codes: dict[str, int] = {}
    processes: list[subprocess.Popen[bytes]] = []
    started = time.monotonic()

    def run(name: str, marker: str) -> None:
        command = [sys.executable, "-m", "pytest", "-m", marker, "--durations=15", f"--basetemp={base / name}"]
        process = subprocess.Popen([*command, *pytest_args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        processes.append(process)
        assert process.stdout is not None
        _relay(name, process.stdout, lock)
        codes[name] = process.wait()
        with lock:
            print(f"[{name}] exit {codes[name]} after {time.monotonic() - started:.0f} s", flush=True)

    # tox stops a command with SIGINT, then SIGTERM: both halves get the same, so that pytest prints its summary.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        if args.one_after_the_other:
            for name, marker in HALVES.items():
                run(name, marker)
        else:
            threads = [threading.Thread(target=run, args=item, daemon=True) for item in HALVES.items()]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
    except KeyboardInterrupt:
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
        for process in processes:
            process.wait()
        raise
    print(f"test halves: {codes} in {time.monotonic() - started:.0f} s", flush=True)
    if set(codes) != set(HALVES):  # a half that never ran (its thread raised before pytest ended) is a failure
        print(f"test halves: no exit status from {sorted(set(HALVES) - set(codes))}", flush=True)
        return 1
    # pytest's 5 (no tests collected) is an error here as it was for the two commands it replaces.
    return next((code for code in codes.values() if code != 0), 0)


if __name__ == "__main__":
    sys.exit(main())
