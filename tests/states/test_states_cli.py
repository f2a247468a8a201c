"""The `d9d-states` command line: convert with a mapping given by import path, and inspect."""

import json
import subprocess
import sys
import threading

import torch
from states_testing import same_bits, write_checkpoint

from d9d.states import mapper as m
from d9d.states import read_model_state
from d9d.states.cli.main import main
from d9d.states.progress import progress_bar

MAPPING_MODULE = """
from d9d.states import mapper as m

def factory(source):
    # fuse every `*.a`/`*.b` pair found in the source into `*.ab`
    stems = sorted({name.rsplit(".", 1)[0] for name in source})
    return m.Parallel([m.Concatenate([f"{s}.a", f"{s}.b"], f"{s}.ab") for s in stems])
"""


def _source(tmp_path):
    generator = torch.Generator().manual_seed(5)
    tensors = {f"l{i}.{part}": torch.randn(2, 3, generator=generator) for i in range(3) for part in "ab"}
    return write_checkpoint(tmp_path / "src", tensors, files=2), tensors


def test_convert_takes_a_mapping_factory_by_import_path(tmp_path, monkeypatch, capsys):
    src, tensors = _source(tmp_path)
    (tmp_path / "pairs_mapping.py").write_text(MAPPING_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(
        ["convert", "--mapping", "pairs_mapping:factory", "--shard-size", "1KB", str(src), str(tmp_path / "out")]
    )
    assert code == 0
    assert "wrote" in capsys.readouterr().out
    out = dict(read_model_state(tmp_path / "out", m.Identity([f"l{i}.ab" for i in range(3)])))
    assert same_bits(out["l1.ab"], torch.cat([tensors["l1.a"], tensors["l1.b"]]))


def test_convert_reports_errors_without_a_traceback(tmp_path, capsys):
    src, _ = _source(tmp_path)
    assert main(["convert", "--mapping", "no_such_module:factory", str(src), str(tmp_path / "out")]) == 2
    assert "No module named 'no_such_module'" in capsys.readouterr().err
    assert main(["convert", "--mapping", "json:dumps", "--shard-size", "lots", str(src), str(tmp_path / "o")]) == 2
    assert "'lots' is not a size" in capsys.readouterr().err


def test_inspect_lists_tensors_and_flags_inconsistencies(tmp_path, capsys):
    src, _ = _source(tmp_path)
    assert main(["inspect", str(src)]) == 0
    out = capsys.readouterr().out
    assert "6 tensors" in out and "with index" in out and "consistent" in out
    assert "l2.b  " in out and "float32" in out and "[2, 3]" in out
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"]["ghost"] = "model-00009-of-00009.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    victim = src / "model-00001-of-00002.safetensors"
    victim.write_bytes(victim.read_bytes()[:-5])
    assert main(["inspect", "--json", str(src)]) == 1
    report = json.loads(capsys.readouterr().out)
    problems = "\n".join(report["problems"])
    assert "names missing file 'model-00009-of-00009.safetensors'" in problems
    assert "model-00001-of-00002.safetensors: truncated" in problems


def test_the_console_script_is_installed():
    script = (
        "from importlib.metadata import entry_points;"
        "print([e.value for e in entry_points(group='console_scripts') if e.name == 'd9d-states'])"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert "d9d.states.cli.main:main" in result.stdout


def test_progress_bars_stay_off_without_a_terminal_and_start_no_thread(capsys):
    threads = threading.active_count()
    with progress_bar(100, "quiet") as bar:  # pytest's stderr is not a TTY
        bar.update(100)
    assert capsys.readouterr().err == ""
    with progress_bar(100, "shown", enabled=True) as bar:
        bar.update(100)
    assert "shown" in capsys.readouterr().err
    assert threading.active_count() == threads
