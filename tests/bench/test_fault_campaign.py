"""A CI-sized run of the fault campaign (`bench/faults.py`): a crashed rank and a damaged checkpoint, each recovered
to the fault-free run's final model bit for bit, with no process left behind and the damage refused."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.isolated
def test_a_handful_of_faults_all_recover_bitwise_with_nothing_left_behind(tmp_path):
    out = tmp_path / "trials.json"
    command = [
        sys.executable, str(ROOT / "bench" / "faults.py"), "--trials", "2", "--seed", "3",
        "--kinds", "kill-rank", "truncate-checkpoint", "--root", str(tmp_path / "campaign"), "--json", str(out),
    ]  # fmt: skip
    completed = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    trials = json.loads(out.read_text())
    assert [trial["kind"] for trial in trials] == ["kill-rank", "truncate-checkpoint"]
    for trial in trials:
        assert trial["recovered"] and not trial["lost_data"], trial
        assert trial["orphans"] == 0 and not trial["corrupt_accepted"] and not trial["outside_changed"], trial
    assert "| **all** | 2 | 2 | 0 | 0 | 0 | 0 |" in completed.stdout
