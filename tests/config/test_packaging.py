"""The package's metadata (pyproject.toml) installs on the stacks users run (issue 39).

torch is admitted through 2.15.x, NGC containers' local pre-release builds (2.15.0a0+...)
included, and 2.16's pre-releases refused; no extra pulls PyPI's `apex` (an unrelated package:
NVIDIA Apex is not on PyPI); megatron-core is an extra, so a container's own stays; the Python
floor is the true one; every third-party module the package imports is declared; the LICENSE
the metadata names is there; and the wheel's package data is what `deadpool files` lists.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from megatron_deadpool.cli import files

REPO = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
DEPENDENCIES = [Requirement(r) for r in PROJECT["dependencies"]]
EXTRAS = {
    extra: [Requirement(r) for r in reqs]
    for extra, reqs in PROJECT["optional-dependencies"].items()
}


def requirement(name: str, reqs: list[Requirement]) -> Requirement | None:
    """The requirement on `name` in `reqs`, or None."""
    found = [r for r in reqs if canonicalize_name(r.name) == canonicalize_name(name)]
    assert len(found) <= 1, found
    return found[0] if found else None


@pytest.mark.parametrize(
    "version, admitted",
    [
        ("2.6.0", True),
        ("2.13.0+cpu", True),
        ("2.14.1", True),
        ("2.15.0", True),
        ("2.15.0+cu130", True),
        ("2.15.0a0+abc", True),  # an NGC container's build
        ("2.15.0a0+git1234567", True),
        ("2.15.2", True),
        ("2.16.0a0", False),
        ("2.16.0a0+abc", False),
        ("2.16.0", False),
        ("2.5.1", False),
    ],
)
def test_torch_specifier_admits_every_2_15_build_and_no_2_16(version: str, admitted: bool) -> None:
    torch = requirement("torch", DEPENDENCIES)
    assert torch is not None
    # pip checks an installed local or pre-release build with prereleases=True.
    assert torch.specifier.contains(version, prereleases=True) is admitted


def test_no_extra_pulls_pypi_apex() -> None:
    for extra, reqs in EXTRAS.items():
        assert requirement("apex", reqs) is None, f"[{extra}] pulls PyPI's apex (not NVIDIA's)"
    assert requirement("apex", DEPENDENCIES) is None


def test_megatron_core_is_an_extra_not_a_dependency() -> None:
    assert requirement("megatron-core", DEPENDENCIES) is None
    core = requirement("megatron-core", EXTRAS["megatron-core"])
    assert core is not None
    # The versions the two CI lanes install.
    assert core.specifier.contains("0.16.1") and core.specifier.contains("0.19.2")
    assert not core.specifier.contains("0.17.0") and not core.specifier.contains("0.20.0")


def test_python_floor_is_3_11() -> None:
    """The code uses typing.Self (devices/cpu.py): 3.10 cannot import it."""
    floor = SpecifierSet(PROJECT["requires-python"])
    assert not floor.contains("3.10.13") and floor.contains("3.11.0") and floor.contains("3.12.1")
    source = (REPO / "megatron_deadpool" / "devices" / "cpu.py").read_text()
    assert "Self" in source


# Top-level modules the package imports -> the distribution that provides them.
DISTRIBUTION = {
    "torch": "torch",
    "numpy": "numpy",
    "yaml": "pyyaml",
    "psutil": "psutil",
    "packaging": "packaging",
    "typing_extensions": "typing_extensions",
    "megatron": "megatron-core",
    "matplotlib": "matplotlib",
    "greenlet": "greenlet",
    "transformer_engine": "transformer-engine",
}
# Imported only when found, never required: NVRx (bench/reproduce/paper_workers.py: the NVRx
# comparison) and triton (replication/triton_checksum.py: torch's CUDA wheels bring it; without
# it the GPU fallback checksums with torch ops).
OPTIONAL_UNDECLARED = {"nvidia_resiliency_ext", "triton"}


def imported_modules() -> set[str]:
    """The top-level third-party modules any module of the package imports."""
    found: set[str] = set()
    for path in (REPO / "megatron_deadpool").rglob("*.py"):
        if "resources" in path.relative_to(REPO).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return {m for m in found if m not in sys.stdlib_module_names and m != "megatron_deadpool"}


def test_every_imported_module_is_declared() -> None:
    declared = {canonicalize_name(r.name) for r in DEPENDENCIES}
    declared |= {canonicalize_name(r.name) for reqs in EXTRAS.values() for r in reqs}
    for module in sorted(imported_modules() - OPTIONAL_UNDECLARED):
        assert module in DISTRIBUTION, f"{module}: which distribution provides it?"
        name = canonicalize_name(DISTRIBUTION[module])
        assert name in declared, f"megatron_deadpool imports {module}: declare {name}"


def test_license_file_is_the_apache_2_0_text() -> None:
    assert PROJECT["license"] == {"text": "Apache-2.0"}
    text = (REPO / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License\n")
    assert "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text


def test_package_data_is_what_deadpool_files_lists() -> None:
    """pyproject's package data under resources/ and `files.PATTERNS` are one list, and every
    pattern matches a file (a moved script would otherwise drop out of the wheel unseen)."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    data = setuptools["package-data"]["megatron_deadpool"]
    resources = [p.removeprefix("resources/") for p in data if p.startswith("resources/")]
    assert resources == list(files.PATTERNS)
    for pattern in files.PATTERNS:
        assert list(files.ROOT.glob(pattern)), f"{pattern} matches nothing"
    for folder in ("scripts", "configs", "patches"):
        link = REPO / "megatron_deadpool" / "resources" / folder
        assert link.is_symlink() and link.resolve() == (REPO / folder).resolve(), link
    assert "README.md" not in files.packaged()


def test_every_data_file_of_the_package_is_package_data() -> None:
    """A file the package reads at run time (kernel sources, bundled traces) is in the wheel: each
    file under megatron_deadpool/ that is not Python (outside resources/, whose links are
    checked above) matches a package-data glob."""
    from fnmatch import fnmatch

    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    globs = setuptools["package-data"]["megatron_deadpool"]
    root = REPO / "megatron_deadpool"
    data = [
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.is_file()
        and "resources" not in p.relative_to(root).parts
        and "__pycache__" not in p.parts
        and p.suffix not in (".py", ".pyc", ".so")
    ]
    assert data, "no data files found: the walk is wrong"
    assert [p for p in data if not any(fnmatch(p, g) for g in globs)] == []
