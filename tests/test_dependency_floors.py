"""No dependency floor allows a version with a known code-execution vulnerability.

Every requirement in every member's pyproject (dependencies and extras) and in tox.ini's dev tools is parsed; for
each package below, every requirement naming it must exclude the last vulnerable release (so it must have a lower
bound at all). Adding a requirement without a floor on one of these packages fails here.
"""

import configparser
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]

# package -> (last vulnerable release, why): the floors set in the pyprojects sit above these.
LAST_VULNERABLE = {
    "pyarrow": ("14.0.0", "CVE-2023-47248: deserialising untrusted IPC/Parquet data runs code (fixed 14.0.1)"),
    "torch": ("2.5.1", "CVE-2025-32434: torch.load(weights_only=True) could run code (fixed 2.6.0)"),
    "transformers": ("4.47.1", "CVE-2024-11392/11393/11394: code execution via model configs (fixed 4.48.0)"),
    "pyyaml": ("5.3.1", "CVE-2020-14343: full_load runs code (fixed 5.4)"),
    "jinja2": ("3.1.5", "CVE-2024-56201/56326, CVE-2025-27516: template code execution (fixed 3.1.6)"),
    "tqdm": ("4.66.2", "CVE-2024-34062: command-line values evaluated as code (fixed 4.66.3)"),
    "setuptools": ("78.1.0", "CVE-2024-6345 (fixed 70.0), CVE-2025-47273 path traversal (fixed 78.1.1)"),
    "numpy": ("1.16.2", "CVE-2019-6446: np.load unpickles by default (fixed 1.16.3)"),
    "psutil": ("5.6.5", "CVE-2019-18874: double free (fixed 5.6.6)"),
}
MUST_BE_DECLARED = {"pyarrow", "torch", "transformers", "pyyaml", "jinja2", "tqdm", "setuptools", "numpy"}


def _declared() -> list[tuple[str, Requirement]]:
    found = []
    for pyproject in sorted([*ROOT.glob("packages/*/pyproject.toml"), ROOT / "flows" / "pyproject.toml"]):
        project = tomllib.loads(pyproject.read_text())["project"]
        lists = [project.get("dependencies", []), *project.get("optional-dependencies", {}).values()]
        found += [(str(pyproject.relative_to(ROOT)), Requirement(text)) for group in lists for text in group]
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    tools = [line.strip() for line in tox["dev"]["tools"].splitlines() if line.strip()]
    found += [("tox.ini [dev] tools", Requirement(text)) for text in tools]
    return found


def test_every_watched_package_is_declared_somewhere():
    names = {canonicalize_name(requirement.name) for _, requirement in _declared()}
    assert {canonicalize_name(name) for name in MUST_BE_DECLARED} <= names


@pytest.mark.parametrize("package", sorted(LAST_VULNERABLE))
def test_no_floor_allows_a_release_with_a_known_code_execution_cve(package):
    vulnerable, why = LAST_VULNERABLE[package]
    for where, requirement in _declared():
        if canonicalize_name(requirement.name) != canonicalize_name(package):
            continue
        assert not requirement.specifier.contains(vulnerable, prereleases=True), (
            f"{where}: {requirement} allows {package} {vulnerable}; {why}"
        )
