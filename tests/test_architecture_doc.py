"""docs/architecture.md is the contributor's map of the code: every module of the three packages is on it.

A module is named by a code span (between backticks) that is its path in the repository
(``sidecar/modelload/sidecar/peers/fetch.py``), its path under its package's folder
(``sidecar/peers/fetch.py``), its dotted name (``modelload.sidecar.peers.fetch``), or its path inside its
package (``peers/fetch.py``) when no other package has a module at that path (``settings.py`` is the
sidecar's and the operator's: it must say which). A package (a folder with ``__init__.py``) is named the
same way, its path ending in ``/``. So a module added without a word on the map fails here, and so does a
name the map keeps after its module is gone.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAP = ROOT / "docs" / "architecture.md"
PACKAGES = ("loader", "sidecar", "operator")


def package_root(package: str) -> Path:
    return ROOT / package / "modelload" / package


def modules() -> list[tuple[str, str]]:
    """``(package, path inside it)`` of every module (``segment/pool.py``) and subpackage (``segment/``)."""
    found = []
    for package in PACKAGES:
        root = package_root(package)
        for path in sorted(root.rglob("*.py")):
            inside = path.relative_to(root).as_posix()
            if path.name != "__init__.py":
                found.append((package, inside))
            elif path.parent != root:
                found.append((package, path.parent.relative_to(root).as_posix() + "/"))
    return found


def spans() -> set[str]:
    """Every code span of the map."""
    return set(re.findall(r"`([^`\n]+)`", MAP.read_text(encoding="utf-8")))


def spellings(package: str, inside: str, *, shared: bool) -> set[str]:
    dotted = f"modelload.{package}." + inside.removesuffix("/").removesuffix(".py").replace("/", ".")
    names = {f"{package}/modelload/{package}/{inside}", f"{package}/{inside}", dotted}
    return names if shared else names | {inside}


def test_there_are_modules_to_map() -> None:
    found = modules()
    assert ("sidecar", "peers/fetch.py") in found and ("loader", "segment/") in found
    assert len(found) > 100


def test_every_module_and_package_is_named_on_the_map() -> None:
    found = modules()
    paths = Counter(inside for _, inside in found)
    named = spans()
    missing = [
        f"{package}/{inside}"
        for package, inside in found
        if not spellings(package, inside, shared=paths[inside] > 1) & named
    ]
    assert not missing, f"docs/architecture.md never names {len(missing)} modules: {', '.join(missing)}"


def test_every_path_the_map_names_in_a_package_exists() -> None:
    stale = []
    for span in spans():
        package = span.split("/", 1)[0]
        if package not in PACKAGES or not span.endswith((".py", "/")):
            continue
        inside = span.removeprefix(f"{package}/modelload/{package}/").removeprefix(f"{package}/")
        if not (package_root(package) / inside).exists():
            stale.append(span)
    assert not stale, f"docs/architecture.md names paths that do not exist: {sorted(stale)}"
