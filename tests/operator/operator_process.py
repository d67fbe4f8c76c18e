"""`pagedllm operator` as a subprocess against an :class:`EmulatedCluster`."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import yaml
from k8s_emulator import EmulatedCluster, wait_for

from tests.support import free_port

DEFAULT_IMAGE = "registry.example/pagedllm:test"


class OperatorProcess:
    """A running operator: its process, log file and liveness URL."""

    def __init__(self, proc: subprocess.Popen, log: Path, liveness: str):
        self.proc, self.log_path, self.liveness = proc, log, liveness

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self, tail: int = 60) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "--- operator log (tail) ---\n" + "\n".join(lines[-tail:])


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def running_operator(
    cluster: EmulatedCluster, workdir: Path, *, startup_timeout: float = 60, extra_args: tuple[str, ...] = ()
):
    """`pagedllm operator --all-namespaces --standalone` against ``cluster``, until the block ends.

    Cluster-wide because kmock cannot list namespaces (which kopf does when given some).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    kubeconfig = workdir / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(cluster.kubeconfig()))
    liveness = f"http://127.0.0.1:{free_port()}/healthz"
    log = workdir / "operator.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    env.update(KUBECONFIG=str(kubeconfig), PYTHONUNBUFFERED="1")
    command = [
        sys.executable,
        "-m",
        "pagedllm.server.entrypoints.cli",
        "operator",
        "--all-namespaces",
        "--standalone",
        "--liveness",
        liveness,
        "--default-image",
        DEFAULT_IMAGE,
        "--verbose",
        *extra_args,
    ]
    with open(log, "wb") as out:
        # NOTE: cwd outside the repo: the operator must run from the installed package alone.
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=workdir)
    handle = OperatorProcess(proc, log, liveness)
    try:
        wait_for(
            lambda: not handle.alive() or _answers(liveness),
            timeout=startup_timeout,
            what="the operator's liveness endpoint",
            on_timeout=handle.log,
        )
        assert handle.alive(), f"the operator exited with {proc.returncode}\n{handle.log()}"
        yield handle
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
