"""Which Prefect API `d9d` reports to: the user's if configured anywhere, else the embedded default (quiet, offline)."""

from d9d.flows.runtime import configure_prefect


def test_embedded_default_is_quiet_offline_and_patient(tmp_path):
    environ = {"D9D_HOME": str(tmp_path / "home")}
    target = configure_prefect(environ)
    assert target.mode == "embedded"
    assert environ["PREFECT_HOME"] == str(tmp_path / "home" / "prefect")
    assert (tmp_path / "home" / "prefect").is_dir()  # Prefect itself would not create the parents
    assert environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] == "300"
    assert environ["PREFECT_UI_ENABLED"] == "false"
    assert environ["DO_NOT_TRACK"] == "1"
    assert environ["PREFECT_SERVER_ANALYTICS_ENABLED"] == "false"
    assert environ["PREFECT_LOGGING_LEVEL"] == "WARNING"
    assert environ["PREFECT_RESULTS_LOCAL_STORAGE_PATH"] == str(tmp_path / "home" / "prefect" / "storage")
    assert "prefect.db" in target.description


def test_user_settings_win_over_the_defaults(tmp_path):
    environ = {"PREFECT_HOME": str(tmp_path / "mine"), "PREFECT_LOGGING_LEVEL": "DEBUG"}
    configure_prefect(environ)
    assert environ["PREFECT_HOME"] == str(tmp_path / "mine")
    assert environ["PREFECT_LOGGING_LEVEL"] == "DEBUG"


def test_configured_api_url_is_used_as_it_is(tmp_path):
    environ = {"PREFECT_API_URL": "http://127.0.0.1:4200/api", "PREFECT_HOME": str(tmp_path)}
    target = configure_prefect(environ)
    assert target.mode == "configured"
    assert "http://127.0.0.1:4200/api" in target.description
    assert "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS" not in environ


def test_api_url_of_the_active_profile_is_used(tmp_path):
    (tmp_path / "profiles.toml").write_text(
        'active = "team"\n[profiles.team]\nPREFECT_API_URL = "http://prefect.internal:4200/api"\n', encoding="utf-8"
    )
    target = configure_prefect({"PREFECT_HOME": str(tmp_path)})
    assert target.mode == "configured"
    assert "prefect.internal" in target.description
