"""The documentation cannot rot: generated references are current, and every command shown
is either run here or says what checks it.

Every `sh`/`bash`/`console`/`python` block of the README, `docs/` and the guides the site
mirrors carries a marker on the line before it:

- `<!-- docs: run -->`     run here (bash or python), against a demo `pagedllm serve`
  started from the page's `server` block (port 8000 in the text becomes a free port);
- `<!-- docs: server -->`  a `pagedllm serve` command line: the server the `run` blocks use;
- `<!-- docs: test PATH[::NAME]] -->` or `<!-- docs: ci PATH -->`  a test or a CI script runs it
  (the path, and the test's name, must exist);
- `<!-- docs: needs cluster|gpu|vllm -->`  it needs what CI has not.

The README's `main-command` and `test-command` markers count as checked by CI (`.ci/run`
runs the test command; `scripts/wheel-smoke.sh` installs the package and serves the demo).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import free_port

ROOT = Path(__file__).resolve().parent.parent


def _mirrored() -> list[str]:
    """The guides the site shows beside docs/ (docs/hooks.py's MIRRORS: one list for both)."""
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    assert spec is not None and spec.loader is not None
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    return list(hooks.MIRRORS)


MIRRORED = _mirrored()
COMMAND_LANGUAGES = {"sh", "bash", "console", "shell", "python"}
NEEDS = {"cluster", "gpu", "vllm"}
CI_MARKERS = {"main-command": "scripts/wheel-smoke.sh", "test-command": ".ci/run"}
_FENCE = re.compile(r"^```(\w+)\s*$")
_MARKER = re.compile(r"^<!--\s*(?:docs:\s*(\w+)\s*(.*?)|(main-command|test-command))\s*-->$")


@dataclass(frozen=True)
class Block:
    path: str
    line: int
    language: str
    kind: str | None
    argument: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def _blocks(path: str) -> list[Block]:
    lines = (ROOT / path).read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        previous = lines[i - 1].strip() if i else ""
        marker = _MARKER.match(previous)
        kind, argument = (None, "")
        if marker:
            kind, argument = (marker.group(1), marker.group(2)) if marker.group(1) else ("ci", "")
            if marker.group(3):
                argument = CI_MARKERS[marker.group(3)]
        blocks.append(Block(path, i + 1, fence.group(1), kind, argument.strip(), "\n".join(lines[i + 1 : end])))
        i = end + 1
    return blocks


def _documents() -> list[str]:
    docs = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md"))
    return ["README.md", *docs, *MIRRORED]


def _command_blocks() -> list[Block]:
    return [b for doc in _documents() for b in _blocks(doc) if b.language in COMMAND_LANGUAGES]


def test_reference_pages_are_generated_from_their_sources():
    result = subprocess.run(
        [sys.executable, "scripts/docs_reference.py", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def test_every_command_block_says_how_it_is_checked():
    problems = []
    for block in _command_blocks():
        if block.kind is None:
            problems.append(f"{block.where}: no <!-- docs: ... --> marker before the block")
        elif block.kind in ("test", "ci"):
            file, _, name = block.argument.partition("::")
            if not file or not (ROOT / file).exists():
                problems.append(f"{block.where}: {block.kind} names {file!r}, which does not exist")
            elif name and not re.search(rf"def {re.escape(name)}\b", (ROOT / file).read_text()):
                problems.append(f"{block.where}: {file} has no test {name!r}")
        elif block.kind == "needs" and block.argument not in NEEDS:
            problems.append(f"{block.where}: needs {block.argument!r}; allowed: {sorted(NEEDS)}")
        elif block.kind not in ("run", "server", "test", "ci", "needs"):
            problems.append(f"{block.where}: unknown marker kind {block.kind!r}")
        elif block.kind == "server" and not block.text.startswith("pagedllm serve"):
            problems.append(f"{block.where}: a server block must be a `pagedllm serve` command line")
    assert not problems, "\n".join(problems)


def test_a_block_without_a_marker_is_reported(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text("text\n\n```sh\necho hi\n```\n\n<!-- docs: needs gpu -->\n```sh\nnvidia-smi\n```\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    blocks = _blocks("page.md")
    assert [(b.kind, b.argument) for b in blocks] == [(None, ""), ("needs", "gpu")]


def _bin_dir() -> str:
    return str(Path(sys.executable).parent)


def _wait_ready(port: int, process: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the docs' server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"the docs' server was not ready within {timeout} s")


@pytest.fixture(scope="module")
def docs_server():
    servers = [b for b in _command_blocks() if b.kind == "server"]
    assert servers, "no <!-- docs: server --> block: the run blocks have no server to talk to"
    port = free_port()
    argv = shlex.split(servers[0].text.replace("\\\n", " "))
    argv = [os.path.join(_bin_dir(), argv[0]), *argv[1:], "--host", "127.0.0.1", "--port", str(port)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait_ready(port, process)
        yield port
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in _command_blocks() if b.kind == "run"], ids=lambda b: b.where)
def test_run_blocks_run(block: Block, docs_server: int):
    text = block.text.replace("127.0.0.1:8000", f"127.0.0.1:{docs_server}")
    env = {**os.environ, "PATH": _bin_dir() + os.pathsep + os.environ.get("PATH", ""), "OMP_NUM_THREADS": "1"}
    if block.language == "python":
        argv = [sys.executable, "-c", text]
    else:
        argv = ["bash", "-euo", "pipefail", "-c", text]
    result = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{block.where} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
