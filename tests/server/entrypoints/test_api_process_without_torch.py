"""With the engine core in its own process, the API server process never loads torch.

The engine core (spawned) imports torch; the process that serves HTTP holds the tokenizer,
templates, grammar checks and metrics only: a fraction of the memory, and a faster start.
"""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest
from api_factories import serve_process

pytestmark = pytest.mark.timeout(300)

API_MODULES = (
    "pagedllm.server.entrypoints.openai.api_server",
    "pagedllm.server.entrypoints.serve",
    "pagedllm.server.entrypoints.cli",
    "pagedllm.server.engine.core_client",
    "pagedllm.server.engine.engine_stats",
    "pagedllm.server.hf_config",
    "pagedllm.server.core.scheduler",
    "pagedllm.server.core.block_manager",
)


def test_the_api_servers_modules_import_no_torch():
    code = "import importlib, sys\n"
    code += "".join(f"importlib.import_module({m!r})\n" for m in API_MODULES)
    code += "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_api_process_does_not_say_pytorch_was_not_found():
    """Transformers notices the torch this process leaves out on purpose; the notice is not a user's concern."""
    code = "from pagedllm.server.entrypoints.serve import keep_torch_out\nkeep_torch_out()\nimport transformers\n"
    code += "import sys\nassert sys.modules['torch'] is None and not transformers.is_torch_available()\n"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "PyTorch was not found" not in run.stderr + run.stdout
    bare = "import sys\nsys.modules['torch'] = None\nimport transformers\n"
    assert (
        "PyTorch was not found" in subprocess.run([sys.executable, "-c", bare], capture_output=True, text=True).stderr
    )


def _maps(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as f:
        return f.read()


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc (Linux)")
def test_a_served_request_leaves_the_api_process_without_torch(tiny_llama):
    with serve_process(tiny_llama) as (proc, url):
        body = {
            "model": "tiny",
            "prompt": "hi",
            "max_tokens": 4,
            "logprobs": 2,
            "response_format": {"type": "json_object"},
        }
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert httpx.get(f"{url}/metrics", timeout=10).status_code == 200
        assert "libtorch" not in _maps(proc.pid)
        # NOTE: the engine core is the process that holds it (the check can see torch where it is)
        assert any("libtorch" in _maps(child) for child in _children(proc.pid))
