"""A header file (a bare token, or header lines) parses into headers, or fails naming the file and the line,
never the value."""

from __future__ import annotations

from pathlib import Path

import pytest

from modelload.loader.errors import ConfigError
from modelload.sidecar.sources import (
    HttpSettings,
    RequestHeaders,
    SourceSettings,
    parse_headers,
    read_header_file,
)
from modelload.sidecar.sources._headers import MAX_HEADER_BYTES

SECRET = "sk-9d2e-header-file-secret-value"


def test_a_bare_token_becomes_a_bearer_authorization_header() -> None:
    for text in (SECRET, f"{SECRET}\n", f"\n  {SECRET}  \r\n\n", f"# the hub's token\n{SECRET}\n"):
        assert parse_headers(text, where="w").items() == (("Authorization", f"Bearer {SECRET}"),)


def test_header_lines_are_sent_as_written_with_comments_and_blank_lines_skipped() -> None:
    text = f"# gateway\r\nX-Api-Key: {SECRET}\r\n\r\nX-Org:research team\nAuthorization: Bearer a:b\n"
    headers = parse_headers(text.encode(), where="w")
    assert headers.items() == (
        ("X-Api-Key", SECRET),
        ("X-Org", "research team"),
        ("Authorization", "Bearer a:b"),
    )
    assert headers.has("authorization") and not headers.has("Cookie")


def test_one_header_line_is_a_header_not_a_token() -> None:
    assert parse_headers(f"X-Api-Key: {SECRET}", where="w").names == ("X-Api-Key",)


def test_the_values_never_show_in_repr_str_or_settings() -> None:
    headers = parse_headers(f"X-Api-Key: {SECRET}\nAuthorization: Bearer {SECRET}", where="w")
    shown = " ".join([repr(headers), str(headers), repr(SourceSettings(http=HttpSettings(headers=headers)))])
    assert "X-Api-Key" in shown and "Authorization" in shown
    assert SECRET not in shown


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "is empty"),
        ("\n# only a comment\n\n", "is empty"),
        (f"Bearer {SECRET}", "line 1: a bare token is one word"),
        (f"X-Api-Key: {SECRET}\n{SECRET}", "line 2: expected 'Name: value'"),
        (f"X-Api-Key: {SECRET}\nX Bad: {SECRET}", "line 2: the header name is empty or holds characters"),
        (f"X-Api-Key : {SECRET}", "line 1: no space is allowed before the ':'"),
        (f": {SECRET}", "line 1: the header name is empty"),
        ("X-Api-Key:", "line 1: the value of X-Api-Key is empty"),
        (f"X-Api-Key: {SECRET}\nx-api-key: {SECRET}", "line 2: x-api-key is already set on line 1"),
        (f"Range: bytes=0-{SECRET}", "line 1: Range is set by the loader itself"),
        (f"host: {SECRET}", "line 1: host is set by the loader itself"),
        (f"X-Api-Key: {SECRET}\x00", r"line 1: the value of X-Api-Key holds a character .* \(column 33 "),
        (f"# comment\nX-Api-Key: caf\u00e9{SECRET}", "line 2: the value of X-Api-Key holds a character"),
        (f"{SECRET}\u00e9", "line 1: the token holds a character that cannot be sent"),
    ],
)
def test_a_malformed_file_names_the_line_and_never_the_value(text: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected) as caught:
        parse_headers(text, where="the Secret 'hub' key 'token'")
    message = str(caught.value)
    assert message.startswith("the Secret 'hub' key 'token'")
    assert SECRET not in message and "bytes=0" not in message


def test_text_that_is_not_utf8_is_refused_without_echoing_it() -> None:
    with pytest.raises(ConfigError, match="not text") as caught:
        parse_headers(b"X-Api-Key: \xff\xfe" + SECRET.encode(), where="w")
    assert SECRET not in str(caught.value)


def test_too_many_lines_are_refused() -> None:
    text = "\n".join(f"X-H{i}: v" for i in range(65))
    with pytest.raises(ConfigError, match="65 header lines; at most 64"):
        parse_headers(text, where="w")


def test_a_file_is_read_and_its_path_named_in_errors(tmp_path: Path) -> None:
    good = tmp_path / "token"
    good.write_text(f"{SECRET}\n")
    assert read_header_file(good).items() == (("Authorization", f"Bearer {SECRET}"),)
    bad = tmp_path / "headers"
    bad.write_text(f"X-Api-Key: {SECRET}\nBearer {SECRET}\n")
    with pytest.raises(ConfigError, match=rf"the header file {bad} \(--header-file\), line 2:") as caught:
        read_header_file(bad, origin="--header-file")
    assert SECRET not in str(caught.value)


def test_a_missing_file_a_directory_and_a_huge_file_are_refused_before_reading(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist: mount the Secret"):
        read_header_file(tmp_path / "absent")
    with pytest.raises(ConfigError, match="is a directory"):
        read_header_file(tmp_path)
    huge = tmp_path / "model.bin"
    with huge.open("wb") as handle:
        handle.truncate(1 << 30)  # sparse: reading it would take a second and a GiB
    with pytest.raises(ConfigError, match=f"holds {1 << 30} bytes, more than the {MAX_HEADER_BYTES}"):
        read_header_file(huge)


def test_headers_compare_by_value() -> None:
    assert parse_headers("a", where="w") == RequestHeaders((("Authorization", "Bearer a"),))
    assert parse_headers("a", where="w") != parse_headers("b", where="w")
    assert not RequestHeaders(())
