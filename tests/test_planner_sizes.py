"""Human sizes for ``--memory``: a table, the refusals, and a round trip."""
from __future__ import annotations

import argparse

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshd.plan.errors import SizeError
from meshd.sizes import MAX_SIZE_BYTES, format_size, parse_size


@pytest.mark.parametrize("text, value", [
    ("4GiB", 4 * 2**30), ("4gib", 4 * 2**30), ("4 GiB", 4 * 2**30), ("4Gi", 4 * 2**30),
    ("4GB", 4 * 10**9), ("4G", 4 * 10**9), ("512MiB", 512 * 2**20), ("512mb", 512 * 10**6),
    ("1.5GiB", 3 * 2**29), ("0.5k", 500), ("1024", 1024), ("7b", 7), (" 2TiB ", 2 * 2**40),
    ("1KiB", 1024), ("3.3333B", 3), ("0", 0), ("1024TiB", MAX_SIZE_BYTES),
])
def test_parse_size_table(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", [
    "", "GiB", "-4GiB", "4 GiBs", "4XB", "4e9", "1,5GiB", ".5GiB", "4GiB4", "inf", "nan",
    "1025TiB", "9" * 40, "4\x00GiB", "４GiB", "4\u212a",
])
def test_parse_size_refuses_with_a_hint(text):
    with pytest.raises(SizeError) as info:
        parse_size(text)
    assert isinstance(info.value, ValueError)


def test_parse_size_refuses_non_text():
    with pytest.raises(SizeError):
        parse_size(4096)  # type: ignore[arg-type]


def test_argparse_prints_a_usage_error_for_a_bad_size(capsys):
    parser = argparse.ArgumentParser()
    parser.add_argument("--memory", type=parse_size)
    assert parser.parse_args(["--memory", "2GiB"]).memory == 2 * 2**30
    with pytest.raises(SystemExit):
        parser.parse_args(["--memory", "lots"])
    assert "invalid parse_size value" in capsys.readouterr().err


@pytest.mark.parametrize("n, text", [
    (0, "0B"), (1023, "1023B"), (1024, "1KiB"), (1536, "1.5KiB"), (4 * 2**30, "4GiB"),
    (1000 * 2**30, "1000GiB"), (2**40 + 2**39, "1.5TiB"),
])
def test_format_size_table(n, text):
    assert format_size(n) == text


@given(st.integers(0, 1023), st.sampled_from(["B", "KiB", "MiB", "GiB", "TiB"]))
def test_exact_binary_sizes_round_trip(count, unit):
    n = parse_size(f"{count}{unit}")
    assert parse_size(format_size(n)) == n


@given(st.text(max_size=40))
def test_parse_size_never_raises_anything_else(text):
    try:
        assert 0 <= parse_size(text) <= MAX_SIZE_BYTES
    except SizeError:
        pass
