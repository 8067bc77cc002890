"""The ledger an integration records into, checked when the job starts (`ledger_check`).

Each wrong ledger is one `ConfigError` that names the setting the user gave, what was wrong and
what to do: an unparsable or unsupported URL, a `postgresql://` URL without its driver (the
extra to install), a server that refuses the connection, a folder that does not exist. A good
URL is opened and migrated, from plain code and from inside a running event loop alike.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from sessions import Ledger
from sessions.errors import ConfigError
from sessions.integrations.ledger_check import check_ledger_sync, open_checked

SETTING = "+ledger.url"


def test_a_postgresql_url_without_its_driver_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "asyncpg", None)  # import asyncpg raises ModuleNotFoundError
    with pytest.raises(ConfigError) as raised:
        check_ledger_sync("postgresql://ledger-host/rollouts", setting=SETTING)
    text = str(raised.value)
    assert text.startswith(SETTING) and "pip install -e '.[postgres]'" in text, text


@pytest.mark.parametrize(
    "url, said",
    [
        ("mysql://host/db", "is not a database URL"),
        ("postgresql://user:secret@127.0.0.1:1/test", "ConnectionRefusedError"),
    ],
)
def test_a_wrong_or_unreachable_url_is_one_error_naming_the_setting(url: str, said: str) -> None:
    with pytest.raises(ConfigError) as raised:
        check_ledger_sync(url, setting=SETTING)
    text = str(raised.value)
    assert text.startswith(SETTING) and said in text, text
    assert "secret" not in text  # a password never reaches a log


def test_a_sqlite_file_in_a_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot open the ledger.*does not exist"):
        check_ledger_sync(str(tmp_path / "missing" / "x.db"), setting=SETTING)


async def test_a_good_url_is_opened_and_migrated_also_inside_a_running_loop(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ledger.db"
    check_ledger_sync(str(path), setting=SETTING, run="r1")  # on a thread: a loop runs here
    async with Ledger.open(str(path), migrate=False) as ledger:  # at head already
        assert await ledger.metrics("train", 0) == []


async def test_errors_of_the_block_itself_pass_unchanged(tmp_path: Path) -> None:
    with pytest.raises(ConnectionResetError, match="the block's own"):
        async with open_checked(str(tmp_path / "x.db"), setting=SETTING):
            raise ConnectionResetError("the block's own")
    with pytest.raises(asyncio.CancelledError):
        async with open_checked(str(tmp_path / "x.db"), setting=SETTING):
            raise asyncio.CancelledError
