"""The wheel holds the whole product: every module and data file of server/, kernels/ and
operator/ at its pagedllm.* path, and the `pagedllm` command.

The wheel is built once per run, from a copy of only the files a build reads (the same
list the Dockerfile copies), with the environment's setuptools and no network.
"""

from __future__ import annotations

import configparser
import fnmatch
import zipfile
from pathlib import Path, PurePosixPath

import pytest
from wheel_build import BUILD_INPUTS, PACKAGE_FOLDERS, ROOT, build_wheel, source_files, wheel_path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest depends on tomli there
    import tomli as tomllib

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    with zipfile.ZipFile(build_wheel(tmp_path_factory.mktemp("wheel"))) as built:
        yield built


def packaged(wheel: zipfile.ZipFile) -> set[str]:
    """The wheel's files under pagedllm/ (not its .dist-info)."""
    return {name for name in wheel.namelist() if name.startswith("pagedllm/") and not name.endswith("/")}


def dist_info(wheel: zipfile.ZipFile, name: str) -> str:
    (path,) = [p for p in wheel.namelist() if PurePosixPath(p).parent.name.endswith(".dist-info") and p.endswith(name)]
    return wheel.read(path).decode()


def package_data_files() -> set[Path]:
    """Source files matched by [tool.setuptools.package-data] (package -> globs relative to its folder)."""
    matched = set()
    for package, patterns in PYPROJECT["tool"]["setuptools"]["package-data"].items():
        folder = source_folder(package)
        for path in source_files(folder.parts[0]):
            relative = path.relative_to(folder) if path.is_relative_to(folder) else None
            if relative is not None and any(fnmatch.fnmatch(str(relative), p) for p in patterns):
                matched.add(path)
    return matched


def source_folder(package: str) -> Path:
    """pagedllm.server.demo -> server/demo, through the package -> folder mapping."""
    top, *rest = package.removeprefix("pagedllm.").split(".")
    assert f"pagedllm/{top}" == PACKAGE_FOLDERS[top], package
    return Path(top, *rest)


def test_every_module_is_in_the_wheel_at_its_mapped_path(wheel):
    expected = {wheel_path(p) for folder in PACKAGE_FOLDERS for p in source_files(folder) if p.suffix == ".py"}
    modules = {name for name in packaged(wheel) if name.endswith(".py")}
    assert not expected - modules, f"modules missing from the wheel: {sorted(expected - modules)}"
    assert not modules - expected, f"modules in the wheel that the tree does not have: {sorted(modules - expected)}"
    # NOTE: the subpackages the first packaging listed by hand and lost; an empty walk cannot pass.
    for module in ("server/core/scheduler.py", "server/entrypoints/cli.py", "server/demo/__init__.py"):
        assert f"pagedllm/{module}" in modules


def test_every_data_file_is_in_the_wheel_and_nothing_else(wheel):
    data = package_data_files()
    demo_model = set(source_files("server/demo/model"))
    # NOTE: compiled where they run, with the headers they include
    c_kernels = {p for p in source_files("kernels") if p.suffix in (".c", ".h")}
    assert demo_model and c_kernels, "an empty walk cannot pass"
    assert data == demo_model | c_kernels, (
        "package-data should be the demo model's files and the C kernels and headers, all of them"
    )
    shipped = {name for name in packaged(wheel) if not name.endswith(".py")}
    assert shipped == {wheel_path(p) for p in data}


def test_operator_is_a_namespace_package(wheel):
    # NOTE: an operator/__init__.py would shadow the standard library's `operator` module.
    assert not (ROOT / "operator" / "__init__.py").exists()
    assert "pagedllm/operator/__init__.py" not in wheel.namelist()
    assert "pagedllm/operator/main.py" in wheel.namelist()


def test_the_pagedllm_command_is_declared(wheel):
    entry_points = configparser.ConfigParser()
    entry_points.read_string(dist_info(wheel, "entry_points.txt"))
    assert dict(entry_points["console_scripts"]) == {"pagedllm": "pagedllm.server.entrypoints.cli:main"}
    assert PYPROJECT["project"]["scripts"] == {"pagedllm": "pagedllm.server.entrypoints.cli:main"}


def test_metadata_names_the_project_and_its_operator_extra(wheel):
    metadata = dist_info(wheel, "METADATA")
    assert f"Version: {PYPROJECT['project']['version']}\n" in metadata
    assert "Provides-Extra: operator\n" in metadata
    for requirement in PYPROJECT["project"]["optional-dependencies"]["operator"]:
        assert f'Requires-Dist: {requirement}; extra == "operator"' in metadata


def test_build_inputs_are_the_project_files_and_the_package_folders():
    # The wheel above was built from these alone; each is read by the build.
    assert PYPROJECT["project"]["readme"] in BUILD_INPUTS
    assert set(PACKAGE_FOLDERS) <= set(BUILD_INPUTS)
    assert {"pyproject.toml", "setup.py"} <= set(BUILD_INPUTS)
    assert all((ROOT / name).exists() for name in BUILD_INPUTS)
