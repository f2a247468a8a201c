"""Build every member's wheel and sdist, check them, and install each member alone in a fresh environment.

For each member this shows that (1) the wheel and sdist pass `twine check`, (2) no artifact ships
`d9d/__init__.py` (d9d is a namespace package shared by all members), and (3) installing the member with only what
it declares, plus PyTorch, gives an importable package whose every module imports, and pulls in exactly the d9d
siblings it declares and no others.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tarfile
import tempfile
import tomllib
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dev_install import local_torch_wheel

ROOT = Path(__file__).resolve().parent.parent
MEMBER_DIRS = [*sorted((ROOT / "packages").iterdir()), ROOT / "flows"]

# Imports the package and every module in it. A module may fail only for a missing top-level package that one of
# the member's extras provides (e.g. d9d.core.testing needs the `testing` extra's pytest); that is reported.
IMPORT_ALL = """
import importlib, pkgutil, sys
root, optional = sys.argv[1], set(sys.argv[2].split(",")) - {""}
package = importlib.import_module(root)
names = [root] + [m.name for m in pkgutil.walk_packages(package.__path__, root + ".")]
needs_extra = []
for name in names:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name.split(".")[0] not in optional:
            raise
        needs_extra.append(f"{name} (needs {error.name})")
print(f"imported {len(names) - len(needs_extra)} of {len(names)} modules of {root}; extras-only: {needs_extra}")
"""


def run(*command: str | Path, cwd: Path | None = None) -> str:
    done = subprocess.run([str(part) for part in command], cwd=cwd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(
            f"command failed ({done.returncode}): {' '.join(map(str, command))}\n{done.stdout}{done.stderr}"
        )
    return done.stdout


def project_of(member: Path) -> dict[str, object]:
    return tomllib.loads((member / "pyproject.toml").read_text())["project"]


def declared_siblings(name: str, projects: dict[str, dict[str, object]]) -> set[str]:
    """The d9d distributions `name` needs, transitively (itself included)."""
    needed = {name}
    stack = [name]
    while stack:
        for requirement in projects[stack.pop()]["dependencies"]:  # type: ignore[attr-defined]
            dep = re.split(r"[<>=!~\[ ;]", requirement, maxsplit=1)[0]
            if dep.startswith("d9d-") and dep not in needed:
                needed.add(dep)
                stack.append(dep)
    return needed


def extra_modules(member: Path) -> list[str]:
    """Top-level module names provided by the member's optional dependencies (distribution name, normalised)."""
    extras: dict[str, list[str]] = project_of(member).get("optional-dependencies", {})  # type: ignore[assignment]
    return [
        re.split(r"[<>=!~\[ ;]", requirement, maxsplit=1)[0].replace("-", "_").lower()
        for requirements in extras.values()
        for requirement in requirements
    ]


def check_artifacts(dist_dir: Path) -> None:
    for artifact in sorted(dist_dir.iterdir()):
        if artifact.suffix == ".whl":
            names = zipfile.ZipFile(artifact).namelist()
        elif artifact.name.endswith(".tar.gz"):
            with tarfile.open(artifact) as archive:
                names = archive.getnames()
        else:
            continue
        offenders = [n for n in names if re.search(r"(^|/)d9d/__init__\.py$", n)]
        if offenders:
            raise SystemExit(f"{artifact.name} ships {offenders[0]}: d9d must stay a namespace package")
    print("  no artifact ships d9d/__init__.py")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("members", nargs="*", help="distribution names to check (default: all)")
    args = parser.parse_args()
    projects = {str(project_of(m)["name"]): project_of(m) for m in MEMBER_DIRS}
    selected = [m for m in MEMBER_DIRS if not args.members or project_of(m)["name"] in args.members]
    with tempfile.TemporaryDirectory(prefix="d9d-packaging-") as tmp:
        dist_dir = Path(tmp) / "dist"
        for member in MEMBER_DIRS:
            run("uv", "build", "--quiet", "--out-dir", dist_dir, member)
        artifacts = sorted([*dist_dir.glob("*.whl"), *dist_dir.glob("*.tar.gz")])
        if len(artifacts) != 2 * len(MEMBER_DIRS):
            raise SystemExit(f"expected a wheel and an sdist per member, built {[a.name for a in artifacts]}")
        run(sys.executable, "-m", "twine", "check", "--strict", *artifacts)
        print(f"twine check passed for {len(artifacts)} artifacts")
        check_artifacts(dist_dir)
        for member in selected:
            name = str(project_of(member)["name"])
            module = "d9d." + name.removeprefix("d9d-")
            venv = Path(tmp) / f"venv-{name}"
            run("uv", "venv", "--quiet", "--python", sys.executable, venv)
            python = venv / "bin" / "python"
            wheel = local_torch_wheel(str(python))
            torch_requirement = str(wheel) if wheel else "torch>=2.11"
            run("uv", "pip", "install", "--quiet", "--python", python, torch_requirement)
            run("uv", "pip", "install", "--quiet", "--python", python, "--find-links", dist_dir, name)
            print(" ", run(python, "-c", IMPORT_ALL, module, ",".join(extra_modules(member))).strip())
            installed = {
                line.split("==")[0]
                for line in run("uv", "pip", "freeze", "--python", python).splitlines()
                if line.startswith("d9d-")
            }
            expected = declared_siblings(name, projects)
            if installed != expected:
                raise SystemExit(f"{name} installed d9d distributions {sorted(installed)}, expected {sorted(expected)}")
            print(f"  {name}: alone with {sorted(expected - {name}) or 'no siblings'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
