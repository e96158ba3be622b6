"""Extra request headers for a private HTTP(S) source: a bearer token or header lines, kept out of sight.

A private artifact server or a model hub's gated repository wants a token on every request. The token comes
from a file (the sidecar's ``--header-file``, mounted from a Kubernetes Secret) or from the Secret itself
(the operator), in one of two shapes:

* a bare token: one line, one word, no colon (``hf_abc...``), sent as ``Authorization: Bearer <token>``;
* header lines: ``Name: value``, one per line, sent as they are. Blank lines and lines starting with ``#``
  are skipped. A token that holds a colon is written this way: ``Authorization: Bearer <token>``.

Parsing checks everything a server would otherwise reject in a way that is hard to read (a header name with
a space, a control character, a value split over two lines) and refuses the headers the sources layer sets
itself (``Range``, ``If-Match``, ``Host``...: overriding them would break the reads' checks). Every error
names where the text came from and the line, never a value: a token pasted in the wrong place must not end
up in a log through its error message.

:class:`RequestHeaders` shows only header names in ``repr`` and ``str``, so settings objects that hold it can
be logged. The values leave it only through :meth:`RequestHeaders.items`, which the HTTP source calls to
build a request.
"""

from __future__ import annotations

import re
from pathlib import Path

from modelload.loader.errors import ConfigError

__all__ = ["MAX_HEADER_BYTES", "RequestHeaders", "parse_headers", "read_header_file", "read_token_file"]

MAX_HEADER_BYTES = 64 * 1024
"""The largest header file accepted: far above any token (JWTs are a few KiB), far below what a server takes
in its request head (nginx: 8 KiB per line by default), so a wrong file (a model, a log) is refused at once
instead of being read."""
MAX_HEADERS = 64

_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")  # RFC 9110 token
_VISIBLE = re.compile(r"^[\x21-\x7e](?:[\x20-\x7e\t]*[\x21-\x7e])?$")  # printable ASCII, inner space/tab
_RESERVED = frozenset(
    {
        "connection",
        "content-length",
        "expect",
        "host",
        "if-match",
        "if-none-match",
        "if-range",
        "keep-alive",
        "proxy-connection",
        "range",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
"""Headers the sources layer or ``http.client`` set per request: a file that set them would break a read's
checks (``Range``, ``If-Match``) or the connection itself."""


class RequestHeaders:
    """Headers sent on every request of an HTTP(S) source; ``repr`` and ``str`` show the names only."""

    __slots__ = ("_items",)

    def __init__(self, items: tuple[tuple[str, str], ...]) -> None:
        self._items = items

    def items(self) -> tuple[tuple[str, str], ...]:
        """The ``(name, value)`` pairs, for building a request; never log them."""
        return self._items

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self._items)

    def has(self, name: str) -> bool:
        """Whether a header of this name (in any case) is set."""
        return any(own.lower() == name.lower() for own, _ in self._items)

    def __repr__(self) -> str:
        return f"RequestHeaders(names={self.names!r})"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RequestHeaders) and other._items == self._items

    def __hash__(self) -> int:
        return hash(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)


def read_header_file(path: Path, *, origin: str | None = None) -> RequestHeaders:
    """Read and parse a header file; ``origin`` says where its path came from (``--header-file``).

    Raises :class:`ConfigError` naming the file (and the line) for a missing, unreadable, oversized or
    malformed file.
    """
    where = f"the header file {path}" + (f" ({origin})" if origin else "")
    try:
        with path.open("rb") as handle:
            size = handle.seek(0, 2)
            if size > MAX_HEADER_BYTES:
                raise ConfigError(
                    f"{where} holds {size} bytes, more than the {MAX_HEADER_BYTES} a token or a few header "
                    "lines need: is it the right file?"
                )
            handle.seek(0)
            data = handle.read(MAX_HEADER_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"{where} does not exist: mount the Secret that holds the token there") from None
    except IsADirectoryError:
        raise ConfigError(f"{where} is a directory: name the file that holds the token") from None
    except OSError as exc:
        raise ConfigError(f"{where} cannot be read: {exc.strerror or type(exc).__name__}") from None
    return parse_headers(data, where=where)


def parse_headers(data: bytes | str, *, where: str) -> RequestHeaders:
    """Parse a bare token or header lines (see the module docstring); ``where`` names the text's origin.

    >>> parse_headers("hf_example\\n", where="the Secret 'hub' key 'token'")
    RequestHeaders(names=('Authorization',))
    >>> parse_headers("X-Api-Key: k1\\nX-Org: research\\n", where="a file").names
    ('X-Api-Key', 'X-Org')
    """
    if isinstance(data, bytes):
        if len(data) > MAX_HEADER_BYTES:
            raise ConfigError(
                f"{where} holds {len(data)} bytes, more than the {MAX_HEADER_BYTES} a token or a few header "
                "lines need: is it the right file?"
            )
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"{where} is not text (a byte that is not UTF-8 at offset {exc.start}): it must hold a token "
                "or header lines"
            ) from None
    else:
        text = data
    text = text.removeprefix("\ufeff")  # a byte order mark from an editor
    lines = [(number, line.rstrip("\r")) for number, line in enumerate(text.split("\n"), start=1)]
    content = [(n, line) for n, line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not content:
        raise ConfigError(f"{where} is empty: it must hold a token, or header lines such as 'Name: value'")
    if len(content) == 1 and ":" not in content[0][1]:
        return RequestHeaders((("Authorization", "Bearer " + _bare_token(*content[0], where=where)),))
    if len(content) > MAX_HEADERS:
        raise ConfigError(f"{where} holds {len(content)} header lines; at most {MAX_HEADERS} are accepted")
    items: list[tuple[str, str]] = []
    seen: dict[str, int] = {}
    for number, line in content:
        name, value = _header_line(number, line, where=where)
        earlier = seen.get(name.lower())
        if earlier is not None:
            raise ConfigError(f"{where}, line {number}: {name} is already set on line {earlier}; set it once")
        seen[name.lower()] = number
        items.append((name, value))
    return RequestHeaders(tuple(items))


def _bare_token(number: int, line: str, *, where: str) -> str:
    token = line.strip()
    if any(c.isspace() for c in token):
        raise ConfigError(
            f"{where}, line {number}: a bare token is one word without spaces; to send a header, write "
            "'Name: value' (for example 'Authorization: Bearer <token>')"
        )
    _check_value(number, "the token", token, where=where)
    return token


def _header_line(number: int, line: str, *, where: str) -> tuple[str, str]:
    name, colon, value = line.partition(":")
    if not colon:
        raise ConfigError(
            f"{where}, line {number}: expected 'Name: value' (a file of several lines holds headers, one per "
            "line; a bare token is a file of one line)"
        )
    if name != name.strip():
        raise ConfigError(f"{where}, line {number}: no space is allowed before the ':' or the header name")
    if not _NAME.match(name):
        raise ConfigError(
            f"{where}, line {number}: the header name is empty or holds characters a header name cannot "
            "(letters, digits and !#$%&'*+-.^_`|~ only)"
        )
    if name.lower() in _RESERVED:
        raise ConfigError(
            f"{where}, line {number}: {name} is set by the loader itself on each request and cannot be "
            "given here"
        )
    value = value.strip(" \t")
    _check_value(number, f"the value of {name}", value, where=where)
    return name, value


def _sendable(char: str) -> bool:
    return "\x20" <= char <= "\x7e" or char == "\t"


def _check_value(number: int, what: str, value: str, *, where: str) -> None:
    if not value:
        raise ConfigError(f"{where}, line {number}: {what} is empty")
    if not _VISIBLE.match(value):
        column = next((i for i, c in enumerate(value, start=1) if not _sendable(c)), 0)
        detail = f" (column {column} of the value)" if column else ""
        raise ConfigError(
            f"{where}, line {number}: {what} holds a character that cannot be sent in a header{detail}: "
            "only printable ASCII is allowed"
        )


def read_token_file(path: Path, *, what: str, origin: str | None = None) -> str:
    """The one token a file holds (a Secret's key mounted as a file), for a store that sends it itself.

    Raises :class:`ConfigError` naming the file, never the value, when it is missing, too large, empty or
    holds more than one word.
    """
    where = f"the {what} file {path}" + (f" ({origin})" if origin else "")
    try:
        with path.open("rb") as handle:
            data = handle.read(MAX_HEADER_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"{where} does not exist: mount the Secret that holds the token there") from None
    except OSError as exc:
        raise ConfigError(f"{where} cannot be read: {exc.strerror or type(exc).__name__}") from None
    if len(data) > MAX_HEADER_BYTES:
        raise ConfigError(f"{where} holds over {MAX_HEADER_BYTES} bytes: is it the right file?")
    try:
        token = data.decode("utf-8").removeprefix("\ufeff").strip()
    except UnicodeDecodeError:
        raise ConfigError(f"{where} is not text: it must hold one token") from None
    if not token or any(c.isspace() for c in token) or not _VISIBLE.match(token):
        raise ConfigError(f"{where} must hold one token: one word of printable ASCII, nothing else")
    return token
