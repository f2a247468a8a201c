"""Every ```python block in a package README runs (in a forked single process, so no interpreter start-up cost)."""

import re
from pathlib import Path

import pytest

from d9d.core.testing import run_on_ranks

ROOT = Path(__file__).resolve().parent.parent
READMES = sorted([*ROOT.glob("packages/*/README.md"), ROOT / "flows" / "README.md"])
BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


def _examples() -> list[tuple[str, str]]:
    found = []
    for readme in READMES:
        for index, code in enumerate(BLOCK.findall(readme.read_text())):
            if not code.startswith("# not run"):
                found.append((f"{readme.parent.name}-{index}", code))
    return found


@pytest.mark.parametrize(("name", "code"), _examples(), ids=[name for name, _ in _examples()])
def test_readme_example_runs(name, code):
    def body():
        exec(compile(code, name, "exec"), {"__name__": "__readme__"})

    run_on_ranks(1, body, init_process_group=False, timeout_seconds=120)
