"""Every install command the docs show runs as written: modelload is not on a package index, so each
installs it from the repository's root, and pip accepts each one there (a dry run, without the network)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def install_commands() -> list[tuple[str, str]]:
    """``(doc, command)`` for every ``pip install`` line in a shell block of the docs that installs this
    project (the path ``.``), as it is written there."""
    found = []
    for doc in DOCS:
        for block in re.findall(r"```sh\n(.*?)```", doc.read_text(), flags=re.S):
            for line in block.splitlines():
                for part in line.split("#", 1)[0].split("&&"):
                    words = shlex.split(part)
                    if words[:2] == ["pip", "install"] and any(w.startswith(".") for w in words[2:]):
                        found.append((doc.name, part.strip()))
    return found


def test_no_doc_installs_modelload_by_name_from_an_index() -> None:
    for doc in DOCS:
        for line in doc.read_text().splitlines():
            if "pip install" in line:
                assert not re.search(r"pip install[^\n]*['\" ]modelload(\[|['\" ]|$)", line), (
                    f"{doc.name}: {line}"
                )


@pytest.mark.parametrize(("doc", "command"), install_commands())
def test_a_documented_install_command_resolves_from_the_repository(doc: str, command: str) -> None:
    words = shlex.split(command)
    targets = [w for w in words[2:] if not w.startswith("-")]
    run = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--dry-run",
        "--no-deps",
        "--no-index",
        "--no-build-isolation",
    ]
    result = subprocess.run(
        [*run, *targets], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, f"{doc}: `{command}` fails: {result.stderr[-2000:]}"
    assert "Would install modelload-" in result.stdout, result.stdout
