"""Starting and stopping the servers a benchmark runs against: `pagedllm serve`, and `vllm serve`
from vLLM's own venv, each on a free loopback port, in a session of its own."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx

from benchmarks import vllm_baseline
from benchmarks.vllm_runner import cpu_env

SERVED_NAME = "bench-model"  # NOTE: both servers answer to it when compared, so one load fits both


def launch(args, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start `pagedllm serve` (with ``args.serve_args``) on a free loopback port; sets ``args.base_url``."""
    proc, args.base_url = launch_ours(args, env)
    return proc


def launch_ours(args, env: dict[str, str] | None = None, python: str = sys.executable) -> tuple[subprocess.Popen, str]:
    """Start `pagedllm serve` (of ``python``'s install) on a free loopback port; the process and its base URL."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    return start_server(our_command(args, port, python), base_url + "/ready", env), base_url


def our_command(args, port: int, python: str = sys.executable) -> list[str]:
    cmd = [python, "-m", "pagedllm.server.entrypoints.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--log-level", "warning"]
    if getattr(args, "model_dir", None):
        cmd += ["--model", args.model_dir, "--served-model-name", SERVED_NAME]
    if getattr(args, "threads", None):
        cmd += ["--cpu-threads", str(args.threads)]
    if getattr(args, "dtype", None):
        cmd += ["--dtype", args.dtype]
    extra = args.serve_args.split()
    return [*cmd, *batch_flags(args, extra), *extra]


def batch_flags(args, extra: list[str]) -> list[str]:
    """``--max-num-seqs`` equal to the client's ``--max-concurrency``, as a user sizes a server for
    its load, unless the server's own extra flags set it."""
    concurrency = getattr(args, "max_concurrency", None)
    if not concurrency or any(flag.split("=")[0] == "--max-num-seqs" for flag in extra):
        return []
    return ["--max-num-seqs", str(concurrency)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(cmd: list[str], ready_url: str, env: dict[str, str] | None = None, log=None) -> subprocess.Popen:
    """Run ``cmd`` in a session of its own (so :func:`stop_server` reaches its children) until
    ``ready_url`` answers 200; its output goes to ``log`` (default: ours)."""
    stderr = subprocess.STDOUT if log else None
    proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=log, stderr=stderr, start_new_session=True)
    try:
        _wait_ready(proc, ready_url, " ".join(cmd))
    except BaseException:  # NOTE: interrupted or failed while starting: it is ours to stop
        stop_server(proc, grace=10)
        raise
    return proc


def _wait_ready(proc: subprocess.Popen, ready_url: str, what: str, limit: float = 600) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            if httpx.get(ready_url, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} before it was ready: {what}")
        time.sleep(0.5)
    raise SystemExit(f"the server was not ready within {limit:.0f} s: {what}")


def stop_server(proc: subprocess.Popen, grace: float = 120) -> None:
    """SIGTERM (a graceful drain) for up to ``grace`` seconds, then SIGKILL to whatever of its
    process group is left (the group it leads: vLLM's engine and worker processes)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def launch_vllm(args, log) -> tuple[subprocess.Popen, str]:
    """Start `vllm serve` of ``args.model_dir`` with ``args.vllm_python``; the process and its base URL."""
    port = free_port()
    extra = args.vllm_serve_args.split()
    extra = [*batch_flags(args, extra), *extra]
    cmd = vllm_baseline.serve_command(args.vllm_python, args.model_dir, port, SERVED_NAME, args.dtype, extra)
    env = cpu_env(args.threads, args.vllm_kv_cache_gib) if args.threads else {}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{args.vllm_kv_cache_gib:g}")
    base_url = f"http://127.0.0.1:{port}"
    return start_server(cmd, base_url + "/health", env, log), base_url
