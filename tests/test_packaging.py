"""The package list in pyproject.toml matches the package folders under loader/, sidecar/ and operator/.

Setuptools does not discover packages across the three roots, so a folder left out of the list would be
missing from the wheel while every test still passes from the source tree.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def packages_on_disk() -> set[str]:
    found = set()
    for top in ("loader", "sidecar", "operator"):
        base = ROOT / top
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            if any(part.startswith(".") or part == "__pycache__" for part in rel.parts):
                continue
            found.add(".".join(rel.parts))
    return found


def test_every_package_folder_is_listed_and_every_listed_package_exists() -> None:
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    on_disk = packages_on_disk()
    assert on_disk - listed == set(), "package folders missing from [tool.setuptools] packages"
    assert listed - on_disk == set(), "listed packages with no folder"


def test_top_level_folders_are_not_packages() -> None:
    for top in ("loader", "sidecar", "operator"):
        assert not (ROOT / top / "__init__.py").exists(), f"{top}/ must contain packages, not be one"
        assert not (ROOT / top / "modelload" / "__init__.py").exists(), "modelload is a namespace package"


def test_package_dirs_map_each_part_to_its_folder() -> None:
    mapping = PYPROJECT["tool"]["setuptools"]["package-dir"]
    assert mapping == {
        "modelload.loader": "loader/modelload/loader",
        "modelload.sidecar": "sidecar/modelload/sidecar",
        "modelload.operator": "operator/modelload/operator",
    }


def test_the_stdlib_operator_module_is_not_shadowed() -> None:
    import operator

    assert hasattr(operator, "itemgetter")


def test_the_license_is_an_spdx_expression_that_setuptools_reads_without_a_warning() -> None:
    import warnings

    from packaging.requirements import Requirement
    from packaging.version import Version
    from setuptools.config.pyprojecttoml import read_configuration

    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the license table's deprecation (builds fail from 2027-02-18) is one
        config = read_configuration(ROOT / "pyproject.toml")
    assert config["project"]["license"] == "Apache-2.0"
    # The SPDX string needs setuptools 77 (PEP 639): the build must not accept an older one.
    (setuptools,) = [
        r for r in map(Requirement, PYPROJECT["build-system"]["requires"]) if r.name == "setuptools"
    ]
    floor = min(Version(s.version) for s in setuptools.specifier if s.operator in (">=", "=="))
    assert floor >= Version("77")
