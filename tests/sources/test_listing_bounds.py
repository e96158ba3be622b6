"""A listing that goes on, page after page of distinct files, is cut off at a count a model never reaches,
with an error that says so, instead of filling the sidecar's memory.

Each page was bounded (16 MiB) and so was the number of pages (256 for the Hub, 64 elsewhere), but not what
they held together: a Hub mirror that answers 256 pages of 180,000 small entries costs about 29 GiB of
listed files (115 MiB a page, measured), an OOM kill that says nothing. The origin here is a small server
that pages on without end, as a lying mirror or emulator would; every page names new files.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest

from modelload.loader.errors import ConfigError
from modelload.sidecar.sources import GcsSettings, HubSettings, SourceSettings, list_directory
from tests.sources.conftest import FAST_SETTINGS

LISTED_FILES_MAX = 100_000
"""The most files a listing holds (``_store.LISTED_FILES_MAX``)."""
COMMIT = "c" * 40
PAGE = 25_000
PAGES = 8
"""Pages the server has in all: more files than a listing may hold, fewer than its page limits."""


class EndlessListing:
    """Answers the Hub's revision and tree API and GCS's objects.list, ``PAGE`` new files a page, for
    ``PAGES`` pages; counts the distinct pages asked for (a page asked again, a retry after a stall on a
    busy machine, is one page)."""

    def __init__(self) -> None:
        self.asked: set[int] = set()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                parts = urlsplit(self.path)
                query = parse_qs(parts.query)
                headers = [("Content-Type", "application/json")]
                if "/revision/" in parts.path:
                    body: object = {"sha": COMMIT}
                elif "/tree/" in parts.path:
                    at = int(query.get("cursor", ["0"])[0])
                    outer.asked.add(at)
                    body = [_hub_entry(at + i) for i in range(PAGE)]
                    if at + PAGE < PAGE * PAGES:
                        base = f"http://127.0.0.1:{outer.port}{parts.path}"
                        headers.append(("Link", f'<{base}?cursor={at + PAGE}>; rel="next"'))
                else:
                    at = int(query.get("pageToken", ["0"])[0])
                    outer.asked.add(at)
                    body = {"items": [_gcs_item(at + i) for i in range(PAGE)]}
                    if at + PAGE < PAGE * PAGES:
                        body["nextPageToken"] = str(at + PAGE)
                data = json.dumps(body).encode()
                self.send_response(200)
                for name, value in headers:
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    @property
    def pages(self) -> int:
        return len(self.asked)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _hub_entry(number: int) -> dict[str, object]:
    return {"type": "file", "oid": f"{number:040x}", "size": 2, "path": f"f{number:07d}.json"}


def _gcs_item(number: int) -> dict[str, object]:
    return {"name": f"model/f{number:07d}.json", "size": "2", "generation": "1", "crc32c": "AAAAAA=="}


@pytest.fixture
def endless() -> Iterator[EndlessListing]:
    server = EndlessListing()
    yield server
    server.close()


def _pages_to_the_limit() -> int:
    return LISTED_FILES_MAX // PAGE + 1


def test_a_hub_listing_of_more_files_than_a_model_holds_is_cut_off_saying_so(endless: EndlessListing) -> None:
    settings = SourceSettings(
        http=FAST_SETTINGS.http, retry=FAST_SETTINGS.retry, hub=HubSettings(endpoint=endless.endpoint)
    )
    with pytest.raises(ConfigError, match=rf"lists more than {LISTED_FILES_MAX} files"):
        list_directory("hf://org/model", settings)
    assert endless.pages == _pages_to_the_limit()


def test_a_gcs_listing_of_more_files_than_a_model_holds_is_cut_off_saying_so(endless: EndlessListing) -> None:
    settings = SourceSettings(
        http=FAST_SETTINGS.http,
        retry=FAST_SETTINGS.retry,
        gcs=GcsSettings(endpoint_url=endless.endpoint, anonymous=True),
    )
    with pytest.raises(ConfigError, match=rf"lists more than {LISTED_FILES_MAX} files"):
        list_directory("gs://models/model/", settings)
    assert endless.pages == _pages_to_the_limit()
