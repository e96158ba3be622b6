"""A throwaway certificate for HTTPS tests: self-signed, for 127.0.0.1 and localhost."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.conftest import find_executable

__all__ = ["find_openssl", "self_signed_certificate"]


def find_openssl() -> str | None:
    """The openssl binary, or None."""
    return find_executable("openssl")


def self_signed_certificate(folder: Path) -> tuple[Path, Path]:
    """Write ``cert.pem`` and ``key.pem`` (valid one day, for IP 127.0.0.1 and DNS localhost) into ``folder``.

    The certificate is its own CA: pass ``cert.pem`` as the CA bundle to trust it.
    """
    binary = find_openssl()
    if binary is None:
        raise FileNotFoundError("openssl is not installed")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        [
            binary,
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
        ],
        check=True,
        capture_output=True,
    )
    return cert, key
