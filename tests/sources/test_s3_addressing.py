"""S3 request URLs: virtual-hosted for AWS and DNS-safe names, path style elsewhere, keys quoted once.

Virtual-hosted requests against a live server are tested in test_s3.py (with a resolver that maps the
bucket's host name to loopback); these tests pin the URL building itself.
"""

from __future__ import annotations

import pytest

from modelload.loader.errors import ConfigError
from modelload.sidecar.sources import plan_s3_location
from modelload.sidecar.sources._s3 import parse_s3_uri


def test_auto_uses_virtual_hosts_on_aws() -> None:
    location = plan_s3_location(
        "models", "llama/w.bin", endpoint_url="https://s3.eu-west-1.amazonaws.com", addressing="auto"
    )
    assert location.addressing == "virtual"
    assert location.url == "https://models.s3.eu-west-1.amazonaws.com/llama/w.bin"


def test_auto_uses_paths_for_dotted_bucket_names_on_aws() -> None:
    location = plan_s3_location(
        "my.models", "w.bin", endpoint_url="https://s3.amazonaws.com", addressing="auto"
    )
    assert location.url == "https://s3.amazonaws.com/my.models/w.bin"


def test_auto_uses_paths_for_custom_endpoints() -> None:
    location = plan_s3_location("models", "w.bin", endpoint_url="http://minio.local:9000", addressing="auto")
    assert location.addressing == "path"
    assert location.url == "http://minio.local:9000/models/w.bin"
    assert location.origin.port == 9000


def test_explicit_addressing_wins_over_auto() -> None:
    virtual = plan_s3_location(
        "models", "w.bin", endpoint_url="http://minio.local:9000", addressing="virtual"
    )
    assert virtual.url == "http://models.minio.local:9000/w.bin"
    path = plan_s3_location("models", "w.bin", endpoint_url="https://s3.amazonaws.com", addressing="path")
    assert path.url == "https://s3.amazonaws.com/models/w.bin"


def test_keys_are_percent_encoded_once_and_slashes_kept() -> None:
    location = plan_s3_location("b", "dir/a b+c~d%.bin", endpoint_url="http://h:1", addressing="path")
    assert location.path == "/b/dir/a%20b%2Bc~d%25.bin"


def test_an_endpoint_path_prefix_is_kept() -> None:
    location = plan_s3_location("b", "k", endpoint_url="http://gateway:8080/s3/", addressing="path")
    assert location.path == "/s3/b/k"


def test_s3_uris_need_a_bucket_and_a_key() -> None:
    assert parse_s3_uri("s3://b/dir/k") == ("b", "dir/k")
    for bad in ("s3://b", "s3://b/", "s3:///k"):
        with pytest.raises(ConfigError, match="s3://BUCKET/KEY"):
            parse_s3_uri(bad)


def test_an_endpoint_without_a_host_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="endpoint"):
        plan_s3_location("b", "k", endpoint_url="http://", addressing="path")
