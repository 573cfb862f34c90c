"""The commands' argument types (tools/argtypes.py): what each accepts, and the one line it says otherwise."""

from __future__ import annotations

import argparse
import re

import pytest

from sparsecomm.tools import argtypes as at


@pytest.mark.parametrize("parse,good,bad,says", [
    (at.positive_int, ("1", "40"), ("0", "-3", "1.5", "x"), "an integer >= 1"),
    (at.int_in(1, 253), ("1", "253"), ("0", "254"), "an integer from 1 to 253"),
    (at.positive_float, ("0.5", "3e2"), ("0", "-1", "inf", "nan"), "a number > 0"),
    (at.density, ("1", "0.01"), ("0", "1.5"), "a number in (0, 1]"),
])
def test_numbers(parse, good, bad, says):
    for text in good:
        value = parse(text)
        assert value == (float(text) if isinstance(value, float) else int(text))
    for text in bad:
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(f"must be {says}, got {text!r}")):
            parse(text)


def test_names_and_lists():
    parse = at.comma_list(at.name_in(lambda: ["dense", "oktopk"], "algorithm"))
    assert parse("oktopk,dense") == ["oktopk", "dense"]
    with pytest.raises(argparse.ArgumentTypeError, match="unknown algorithm 'x'; choose from dense, oktopk"):
        parse("oktopk,x")
    with pytest.raises(argparse.ArgumentTypeError, match="empty element"):
        parse("oktopk,,dense")


def test_checked_by_keeps_the_text_and_the_checks_message():
    def check(text):
        if text != "ok":
            raise ValueError(f"{text!r} is not ok")
    parse = at.checked_by(check, "thing")
    assert parse("ok") == "ok"
    with pytest.raises(argparse.ArgumentTypeError, match="'no' is not ok"):
        parse("no")


def test_paths(tmp_path):
    (tmp_path / "file").write_text("")
    assert at.out_folder(str(tmp_path / "new")) == str(tmp_path / "new")
    with pytest.raises(argparse.ArgumentTypeError, match="is not a folder"):
        at.out_folder(str(tmp_path / "file"))
    assert at.new_file(str(tmp_path / "out.json")) == str(tmp_path / "out.json")
    with pytest.raises(argparse.ArgumentTypeError):
        at.new_file(str(tmp_path))
