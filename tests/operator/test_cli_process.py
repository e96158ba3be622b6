"""``modelload operator`` as the chart runs it: a process configured by MODELLOAD_OPERATOR_* variables that
logs in from a kubeconfig, serves the webhook and kopf's health endpoint, and exits cleanly on SIGTERM.

The API server is KMock, served by this test's event loop while the operator runs in its own process.
"""

from __future__ import annotations

import asyncio
import base64
import os
import shutil
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.operator.conftest import MWC, MWC_NAME, OPERATOR_NAMESPACE, current, wait_for

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def kubeconfig(path: Path, server: str) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "kmock", "cluster": {"server": server}}],
                "users": [{"name": "tester", "user": {"token": "not-a-real-token"}}],
                "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "tester"}}],
                "current-context": "kmock",
            }
        )
    )
    return path


async def get_status(url: str, **options: Any) -> int:
    try:
        async with httpx.AsyncClient(timeout=2, **options) as client:
            return (await client.get(url)).status_code
    except httpx.HTTPError:
        return 0


async def test_the_operator_command_serves_and_stops_on_sigterm(kube: Any, tmp_path: Path) -> None:
    command = shutil.which("modelload", path=str(Path(sys.executable).parent)) or shutil.which("modelload")
    assert command is not None, "the modelload console script is not installed"
    webhook_port, health_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MODELLOAD_", "KUBERNETES_"))}
    env |= {
        "KUBECONFIG": str(kubeconfig(tmp_path / "kubeconfig", str(kube.url).rstrip("/"))),
        "MODELLOAD_OPERATOR_NAMESPACE": OPERATOR_NAMESPACE,
        "MODELLOAD_OPERATOR_WEBHOOK_HOST": "127.0.0.1",
        "MODELLOAD_OPERATOR_WEBHOOK_PORT": str(webhook_port),
        "MODELLOAD_OPERATOR_LIVENESS_PORT": str(health_port),
        "MODELLOAD_OPERATOR_CERT_DIR": str(tmp_path / "certs"),
        "MODELLOAD_OPERATOR_LOG_LEVEL": "INFO",
    }
    process = await asyncio.create_subprocess_exec(
        command, "operator", env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    try:
        ready = f"https://127.0.0.1:{webhook_port}/readyz"

        async def webhook_ready() -> bool:
            assert process.returncode is None, (await process.communicate())[0].decode()[-3000:]
            return await get_status(ready, verify=False) == 200

        await wait_for(webhook_ready, timeout=30, what="the webhook ready")
        assert await get_status(f"http://127.0.0.1:{health_port}/healthz") == 200
        mwc = await wait_for(lambda: current(kube, MWC, None, MWC_NAME), what="the webhook configuration")
        ca = base64.b64decode(mwc["webhooks"][0]["clientConfig"]["caBundle"])
        assert b"BEGIN CERTIFICATE" in ca
        process.send_signal(signal.SIGTERM)
        output, _ = await asyncio.wait_for(process.communicate(), timeout=30)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert process.returncode == 0, output.decode()[-3000:]
    assert b"not-a-real-token" not in output
