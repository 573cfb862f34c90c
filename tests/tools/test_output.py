"""Result files in and out (tools/output.py): JSON rows, and one line naming a bad input file."""

from __future__ import annotations

import io
from dataclasses import dataclass

import pytest

from sparsecomm.errors import InputFileError
from sparsecomm.tools.output import progress, read_json, write_json


@dataclass
class Row:
    name: str
    value: float


def test_rows_round_trip(tmp_path):
    path = str(tmp_path / "rows.json")
    write_json([Row("a", 1.5), {"name": "b", "value": 2}], path)
    assert read_json(path) == [{"name": "a", "value": 1.5}, {"name": "b", "value": 2}]


@pytest.mark.parametrize("make,why", [
    (lambda p: None, "no such file"),
    (lambda p: p.mkdir(), "is a folder"),
    (lambda p: p.write_text("{"), "not JSON"),
    (lambda p: p.write_bytes(b"\xff\xfe{"), "not JSON"),
])
def test_a_bad_input_file_is_named(tmp_path, make, why):
    path = tmp_path / "in.json"
    make(path)
    with pytest.raises(InputFileError, match=why):
        read_json(str(path))


def test_progress_is_quiet_off_a_terminal(monkeypatch):
    monkeypatch.setattr("sys.stderr", io.StringIO())
    assert list(progress(range(3), total=3)) == [0, 1, 2]
    assert "it/s" not in __import__("sys").stderr.getvalue()
