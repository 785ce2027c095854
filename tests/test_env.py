"""Seconds from environment variables (:func:`hpsray.env.env_seconds`) and the three settings
that read them: the fault timeout, Ray's start bound and the progress interval."""

import pytest

from hpsray.cluster import faults, runtime
from hpsray.env import env_seconds
from hpsray.errors import ConfigError
from hpsray.pipelines import progress

NAME = "HPSRAY_TEST_SECONDS"


def test_unset_or_blank_gives_the_default_and_a_number_is_read(monkeypatch):
    monkeypatch.delenv(NAME, raising=False)
    assert env_seconds(NAME, 7.0) == 7.0
    monkeypatch.setenv(NAME, "  ")
    assert env_seconds(NAME, 7.0) == 7.0
    monkeypatch.setenv(NAME, " 2.5 ")
    assert env_seconds(NAME, 7.0) == 2.5
    monkeypatch.setenv(NAME, "0")
    assert env_seconds(NAME, 7.0, zero_ok=True) == 0.0


@pytest.mark.parametrize(
    ("raw", "zero_ok"), [("soon", False), ("0", False), ("-1", True), ("nan", True), ("inf", True)]
)
def test_a_bad_value_names_the_variable_and_the_value(monkeypatch, raw, zero_ok):
    monkeypatch.setenv(NAME, raw)
    with pytest.raises(ConfigError) as e:
        env_seconds(NAME, 7.0, zero_ok=zero_ok)
    assert isinstance(e.value, ValueError)
    assert str(e.value).startswith(f"environment: {NAME}: must be a finite number of seconds")
    assert repr(raw) in str(e.value)


def test_the_three_settings_keep_their_variables_and_defaults(monkeypatch):
    settings = [
        ("HPSRAY_FAULT_TIMEOUT_S", faults.fault_timeout, 90.0, "0"),
        ("HPSRAY_RAY_START_SECONDS", runtime.start_seconds, 120.0, "-1"),
        ("HPSRAY_PROGRESS_SECONDS", progress.progress_seconds, 30.0, "-1"),
    ]
    monkeypatch.setitem(faults._state, "timeout", None)  # no job configured this process
    for name, read, default, bad in settings:
        monkeypatch.delenv(name, raising=False)
        assert read() == default
        monkeypatch.setenv(name, "3")
        assert read() == 3.0
        monkeypatch.setenv(name, bad)
        with pytest.raises(ConfigError, match=name):
            read()
    monkeypatch.setenv("HPSRAY_RAY_START_SECONDS", "0")  # try once
    monkeypatch.setenv("HPSRAY_PROGRESS_SECONDS", "0")  # no timed lines
    assert runtime.start_seconds() == 0.0 and progress.progress_seconds() == 0.0
