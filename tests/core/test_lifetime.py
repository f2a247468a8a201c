"""A rank started by torchrun dies with it: `die_with_launcher` has the kernel SIGKILL the process when its parent
exits, so a SIGKILLed launcher leaves no rank running (checked with a real parent and child process)."""

import os
import signal
import subprocess
import sys

import psutil
import pytest

CHILD = (
    "from d9d.core.dist.lifetime import die_with_launcher; import time; "
    "print(die_with_launcher(), flush=True); time.sleep(600)"
)
PARENT = f"""
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", {CHILD!r}], stdout=subprocess.PIPE, text=True)
print(child.pid, child.stdout.readline().strip(), flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_the_child_is_killed_when_its_parent_is_sigkilled():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    pid_text, arranged = parent.stdout.readline().split()
    child = psutil.Process(int(pid_text))
    assert arranged == "True" and child.is_running()
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    gone, _ = psutil.wait_procs([child], timeout=20)
    assert gone, "the child outlived its SIGKILLed parent"
