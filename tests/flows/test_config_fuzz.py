"""Fuzzing `--set` overrides (hypothesis): whatever key and value a user types, the job config either loads or fails
with a `JobConfigError` naming the key; never another exception (a traceback) and never a non-finite number. The same
through the `d9d` command line: exit 0 or 2 with one `d9d: error:` message, no traceback."""

import contextlib
import io

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from d9d.core.config import non_finite_fields
from d9d.core.config.overrides import models_in
from d9d.flows.cli import main
from d9d.flows.jobs.config import JobConfig
from d9d.flows.jobs.loading import JobConfigError, load_job_config


def _paths(model: type[BaseModel], prefix: str = "", depth: int = 0) -> list[str]:
    found = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        found.append(path)
        if depth < 3:
            for inner in models_in(field.annotation):
                found += _paths(inner, f"{path}.", depth + 1)
    return sorted(set(found))


KEYS = _paths(JobConfig)
VALUES = st.one_of(
    st.sampled_from([".inf", "-.inf", ".nan", "nan", "1e999", "null", "[]", "{}", "[1, 2]", "{a: 1}", "-1", "0",
                     "true", "''", "[", "{", "a: b: c", "!!python/object:os.system", "\x00", "../..", "1e-320"]),
    st.integers(-(2**70), 2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(max_size=12),
)  # fmt: skip
KEY_TEXT = st.one_of(
    st.sampled_from(KEYS),
    st.builds(lambda key, junk: f"{key}.{junk}", st.sampled_from(KEYS), st.text(min_size=1, max_size=6)),
    st.text(max_size=10),
)


@pytest.mark.isolated  # hypothesis keeps a database thread-free, but runs long enough to stay out of the fork batch
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=KEY_TEXT, value=VALUES)
def test_any_override_loads_or_fails_naming_the_key(tmp_path_factory, key, value):
    base = tmp_path_factory.getbasetemp()
    message = None
    try:
        config = load_job_config(preset_name="micro", overrides=[f"{key}={value}"], base=base)
    except JobConfigError as error:
        message = str(error)
    if message is not None:
        first = key.partition("=")[0].split(".")[0].strip()
        assert first in message or "--set" in message, (key, value, message)
    else:
        assert non_finite_fields(config) == [], (key, value)


@pytest.mark.isolated
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=KEY_TEXT, value=VALUES)
def test_the_command_line_answers_any_override_without_a_traceback(key, value):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["show-config", "--preset", "micro", "--set", f"{key}={value}"])
        except SystemExit as exit_:  # argparse's own usage errors (e.g. a key that looks like an option)
            code = exit_.code
    assert code in (0, 2), (key, value, code, err.getvalue())
    assert "Traceback" not in err.getvalue()
    if code == 2:
        assert err.getvalue().startswith(("d9d: error:", "usage:")), err.getvalue()
