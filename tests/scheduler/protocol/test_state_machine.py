"""The state machine's scripts name every record field and status through job_record and JobStatus, and
every terminal write of a job goes through the one commit_terminal."""

from __future__ import annotations

import re

import pytest

from scheduler.protocol import job_record, state_machine
from scheduler.protocol.job import TERMINAL_STATUSES, JobStatus

SCRIPTS = {name: value for name, value in vars(state_machine).items()
           if name.isupper() and not name.startswith("_") and isinstance(value, str) and "\n" in value}
"""The module's scripts (its one-line string constants, imported tenant names among them, are no scripts)."""
JOB_RECORD_SCRIPTS = ("ENQUEUE", "RELEASE_KEY", "START", "STEP", "RENEW_LEASE", "HAND_BACK", "COMMIT", "CANCEL")


def test_every_script_has_its_names_filled_in() -> None:
    assert {"ENQUEUE", "START", "STEP", "COMMIT", "CANCEL", "HAND_BACK", "RENEW_LEASE"} <= set(SCRIPTS)
    for name, source in SCRIPTS.items():
        assert re.search(r"redis\.call\(", source), name
        assert not re.search(r"@\w+@", source), f"{name} keeps a placeholder"


def test_terminal_statuses_are_the_job_statuses() -> None:
    terminal = re.search(r"local function terminal\(s\) return (.*) end", SCRIPTS["COMMIT"])
    assert terminal is not None
    assert set(re.findall(r"s == '(\w+)'", terminal.group(1))) == {s.value for s in TERMINAL_STATUSES}


def test_one_terminal_commit_serves_the_worker_and_the_gateway() -> None:
    status_write = re.compile(r"redis\.call\('HSET', \w+(\[1\])?, '" + job_record.F_STATUS + "'")
    for name in ("COMMIT", "CANCEL"):
        source = SCRIPTS[name]
        assert source.count("commit_terminal(") == 2, name  # defined once, called once
        # The record's status is written in commit_terminal alone.
        assert len(status_write.findall(source)) == 1, name
    for name in JOB_RECORD_SCRIPTS:
        if name in ("COMMIT", "CANCEL"):
            continue
        # No other script writes a terminal status (START only reads them, through terminal()).
        for status in TERMINAL_STATUSES:
            assert f"'{status.value}'" not in SCRIPTS[name].replace(state_machine._TERMINAL, ""), (name, status)


def test_an_unknown_name_is_refused() -> None:
    with pytest.raises(KeyError, match="@nope@"):
        state_machine._job_script("return '@nope@'")
    assert state_machine._job_script("'@queued@' '@stream_entry@'") == f"'{JobStatus.QUEUED.value}' '{job_record.F_STREAM_ENTRY}'"
