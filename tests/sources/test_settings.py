"""Settings refuse impossible values with a ConfigError that names the setting."""

from __future__ import annotations

import pytest

from modelload.loader.errors import ConfigError
from modelload.sidecar.sources import HttpSettings, RetryPolicy, S3Settings, SourceSettings


def test_defaults_are_valid_and_grouped() -> None:
    settings = SourceSettings()
    assert settings.http.stall_timeout > 0
    assert settings.retry.attempts >= 1
    assert settings.s3.addressing == "auto"


@pytest.mark.parametrize(
    ("factory", "words"),
    [
        (lambda: HttpSettings(connect_timeout=0), "connect_timeout"),
        (lambda: HttpSettings(stall_timeout=float("inf")), "stall_timeout"),
        (lambda: HttpSettings(max_redirects=-1), "max_redirects"),
        (lambda: RetryPolicy(attempts=0), "attempts"),
        (lambda: RetryPolicy(initial_backoff=2, max_backoff=1), "backoff"),
        (lambda: RetryPolicy(jitter=1.5), "jitter"),
        (lambda: RetryPolicy(deadline=-1), "deadline"),
        (lambda: S3Settings(addressing="dns"), "addressing"),  # type: ignore[arg-type]
        (lambda: S3Settings(endpoint_url="minio:9000"), "endpoint"),
    ],
)
def test_impossible_settings_are_refused_by_name(factory: object, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        factory()  # type: ignore[operator]


def test_backoff_doubles_up_to_the_maximum() -> None:
    policy = RetryPolicy(initial_backoff=0.5, max_backoff=3.0)
    assert [policy.backoff(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]
