"""`pagedllm --version` and the HTTP API's /version report one version: the distribution's."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from pagedllm.server import version as version_module
from pagedllm.server.args import engine_config_from_args
from pagedllm.server.entrypoints.cli import build_parser, main
from pagedllm.server.entrypoints.openai.api_server import build_app
from pagedllm.server.version import UNKNOWN_VERSION, package_version, source_version

ROOT = Path(__file__).resolve().parents[2]


def test_installed_version_is_the_one_pyproject_declares():
    declared = source_version(ROOT / "pyproject.toml")
    assert declared is not None and declared != UNKNOWN_VERSION
    assert package_version() == metadata.version("pagedllm") == declared


def test_cli_prints_the_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"pagedllm {package_version()}\n"


def test_http_version_is_the_clis():
    config = engine_config_from_args(build_parser().parse_args(["serve"]))
    # NOTE: no `with`: the lifespan (which loads the model) does not run; /version needs no engine.
    client = TestClient(build_app(config))
    response = client.get("/version")
    assert response.status_code == 200
    assert response.json() == {"version": package_version()}
    assert client.get("/").json()["version"] == package_version()


def not_installed(name: str) -> str:
    raise metadata.PackageNotFoundError(name)


def test_a_source_checkout_reports_its_pyproject_version(monkeypatch):
    monkeypatch.setattr(version_module.metadata, "version", not_installed)
    assert package_version() == source_version(ROOT / "pyproject.toml")


@pytest.mark.parametrize(
    "pyproject",
    [None, '[project]\nname = "other"\nversion = "9.9"\n', '[project]\nname = "pagedllm"\n', "not = [toml"],
    ids=["missing", "another-project", "no-version", "unreadable"],
)
def test_unknown_version_without_metadata_or_project_file(monkeypatch, tmp_path, pyproject):
    path = tmp_path / "pyproject.toml"
    if pyproject is not None:
        path.write_text(pyproject)
    monkeypatch.setattr(version_module.metadata, "version", not_installed)
    monkeypatch.setattr(version_module, "SOURCE_PYPROJECT", path)
    assert source_version(path) is None
    assert package_version() == UNKNOWN_VERSION
