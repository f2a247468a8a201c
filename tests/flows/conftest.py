"""Shared fixtures for the d9d-flows tests: small real corpora in three formats, and clean fault injection."""

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from flows_corpora import TEXTS

from d9d.flows.jobs.faults import FAULT_ENV, reset_faults


@pytest.fixture(autouse=True)
def _no_injected_faults(monkeypatch):
    monkeypatch.delenv(FAULT_ENV, raising=False)
    reset_faults()
    yield
    reset_faults()


@pytest.fixture
def corpus_dir(tmp_path):
    """Two .txt files, a .jsonl with a blank line, and a .parquet with two row groups: 10 documents in all."""
    root = tmp_path / "corpus"
    (root / "plays").mkdir(parents=True)
    (root / "plays" / "a.txt").write_text(TEXTS[0], encoding="utf-8")
    (root / "plays" / "b.txt").write_text(TEXTS[1], encoding="utf-8")
    lines = [json.dumps({"text": TEXTS[2], "id": 1}), "", json.dumps({"text": TEXTS[3]})]
    (root / "records.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    table = pa.table({"text": [TEXTS[4], TEXTS[5], TEXTS[0], TEXTS[1], TEXTS[2], TEXTS[3]]})
    pq.write_table(table, root / "rows.parquet", row_group_size=3)
    return root


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory):
    """The embedded Prefect API (SQLite in a temporary home), exactly as `d9d` uses it with nothing configured.

    Only `isolated` tests may use it: Prefect starts threads. It starts on the first flow run (15-40 s) and serves
    every later test of the session.
    """
    saved = dict(os.environ)
    for name in list(os.environ):
        if name.startswith("PREFECT_"):
            del os.environ[name]
    os.environ["D9D_HOME"] = str(tmp_path_factory.mktemp("d9d-home"))
    from d9d.flows.runtime import configure_prefect

    target = configure_prefect()
    assert target.mode == "embedded"
    yield target
    os.environ.clear()
    os.environ.update(saved)
