"""`pagedllm download` (server/entrypoints/download.py), offline.

Nothing here leaves loopback: the Hub path runs the real huggingface_hub client (in a
`pagedllm download` subprocess) against a small fake Hub on 127.0.0.1 (``HF_ENDPOINT``), and
the s3 / gs paths run stand-in ``aws`` / ``gcloud`` executables that copy from a local
directory. So what is checked is our side: the requests and arguments each tool gets, the
completion marker, resuming, and the errors for a missing tool or credential; not the real
stores' behaviour.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import huggingface_hub
import huggingface_hub.errors
import pytest

from pagedllm.server.entrypoints import download as dl
from pagedllm.server.entrypoints.cli import main

SYSTEM_PATH = "/usr/bin:/bin"


def fake_tool(bin_dir: Path, name: str, script: str) -> None:
    bin_dir.mkdir(exist_ok=True)
    path = bin_dir / name
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.mark.parametrize(
    "text, scheme, location",
    [
        ("hf://org/name", "hf", "org/name"),
        ("org/name", "hf", "org/name"),
        ("s3://bucket/llama/7b/", "s3", "bucket/llama/7b"),
        ("gs://bucket/p", "gs", "bucket/p"),
    ],
)
def test_sources(text, scheme, location):
    assert dl.parse_source(text) == dl.Source(scheme, location)


@pytest.mark.parametrize("text", ["ftp://x/y", "s3://", "hf://org/../etc", "pvc://claim/path"])
def test_sources_refused_say_what_is_allowed(text):
    with pytest.raises(dl.DownloadError, match=r"use hf://ORG/NAME .* s3://BUCKET/PREFIX or gs://BUCKET/PREFIX"):
        dl.parse_source(text)


def recording_fetcher(calls: list):
    def fetch(source, dest, revision, env):
        calls.append((str(source), dest, revision))
        (dest / "config.json").write_text("{}")

    return fetch


def test_the_marker_is_written_last_and_a_second_run_does_nothing(tmp_path):
    calls: list = []
    fetchers = {"hf": recording_fetcher(calls)}
    source = dl.parse_source("hf://org/name")
    assert dl.download(source, tmp_path / "m", "abc", fetchers=fetchers) is True
    assert json.loads((tmp_path / "m" / dl.MARKER).read_text()) == {"source": "hf://org/name", "revision": "abc"}
    assert dl.download(source, tmp_path / "m", "abc", fetchers=fetchers) is False
    assert len(calls) == 1
    # Another revision into the same directory is not taken for the one there.
    assert dl.download(source, tmp_path / "m", "def", fetchers=fetchers) is True
    assert len(calls) == 2


def test_a_failed_download_leaves_no_marker(tmp_path):
    def broken(source, dest, revision, env):
        (dest / "part").write_text("half")
        raise dl.DownloadError("cut short")

    with pytest.raises(dl.DownloadError, match="cut short"):
        dl.download(dl.parse_source("s3://b/p"), tmp_path, None, fetchers={"s3": broken})
    assert not (tmp_path / dl.MARKER).exists()
    assert not dl.is_complete(tmp_path, dl.parse_source("s3://b/p"), None)


def test_revisions_are_for_the_hub_only(tmp_path):
    with pytest.raises(dl.DownloadError, match=r"--revision='v1' is not allowed with s3://b/p: only hf://"):
        dl.download(dl.parse_source("s3://b/p"), tmp_path, "v1", fetchers={})


def test_the_hub_path_passes_id_revision_and_directory(tmp_path, monkeypatch):
    calls = []

    def snapshot_download(**kwargs):
        calls.append(kwargs)
        Path(kwargs["local_dir"], "model.safetensors").write_bytes(b"w")
        return kwargs["local_dir"]

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    dest = tmp_path / "org" / "name@v2"
    assert main(["download", "hf://org/name", str(dest), "--revision", "v2"]) == 0
    assert calls == [
        {"repo_id": "org/name", "revision": "v2", "local_dir": str(dest), "ignore_patterns": ["original/*"]}
    ]
    assert dl.is_complete(dest, dl.parse_source("hf://org/name"), "v2")


def test_a_gated_hub_model_without_a_token_says_to_give_one(tmp_path, monkeypatch):
    def refused(**kwargs):
        response = httpx.Response(401, request=httpx.Request("GET", "https://huggingface.co/api/models/org/gated"))
        raise huggingface_hub.errors.RepositoryNotFoundError("401 Client Error", response=response)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refused)
    with pytest.raises(
        dl.DownloadError, match="missing, private or gated.*HF_TOKEN is not set: give one through hfTokenSecret"
    ):
        dl.download(dl.parse_source("org/gated"), tmp_path, None, env={})


def test_s3_syncs_with_the_aws_cli(tmp_path):
    bucket = tmp_path / "bucket-root" / "b" / "llama"
    bucket.mkdir(parents=True)
    (bucket / "config.json").write_text("{}")
    # The stand-in maps s3://B/P to $FAKE_S3/B/P and checks the credentials reached it.
    fake_tool(
        tmp_path / "bin",
        "aws",
        '[ "$1 $2" = "s3 sync" ] || exit 9\n[ "$AWS_ACCESS_KEY_ID" = "AK" ] || exit 8\n'
        'src="$FAKE_S3/${3#s3://}"; cp -r "$src/." "$4"\n',
    )
    env = {
        "PATH": f"{tmp_path / 'bin'}:{SYSTEM_PATH}",
        "FAKE_S3": str(tmp_path / "bucket-root"),
        "AWS_ACCESS_KEY_ID": "AK",
    }
    dest = tmp_path / "models" / "s3" / "b" / "llama"
    assert dl.download(dl.parse_source("s3://b/llama"), dest, None, env=env) is True
    assert (dest / "config.json").read_text() == "{}" and dl.is_complete(dest, dl.parse_source("s3://b/llama"), None)


def test_s3_without_the_cli_says_what_to_install(tmp_path):
    with pytest.raises(
        dl.DownloadError, match=r"s3://b/p needs the aws CLI \(awscli\) in the image, and `aws` is not on PATH"
    ):
        dl.download(dl.parse_source("s3://b/p"), tmp_path, None, env={"PATH": str(tmp_path)})


def test_s3_without_credentials_says_where_they_come_from(tmp_path):
    fake_tool(tmp_path / "bin", "aws", 'echo "Unable to locate credentials" >&2; exit 1\n')
    env = {"PATH": f"{tmp_path / 'bin'}:{SYSTEM_PATH}"}
    with pytest.raises(dl.DownloadError) as info:
        dl.download(dl.parse_source("s3://b/p"), tmp_path / "d", None, env=env)
    message = str(info.value)
    assert "aws exit 1): Unable to locate credentials" in message
    assert "no AWS credentials in the environment" in message and "spec.modelSource.credentialsSecret" in message
    assert not (tmp_path / "d" / dl.MARKER).exists()


def test_gs_gets_the_key_as_a_file(tmp_path):
    fake_tool(
        tmp_path / "bin",
        "gcloud",
        '[ "$1 $2 $3" = "storage rsync --recursive" ] || exit 9\n'
        'grep -q service_account "$GOOGLE_APPLICATION_CREDENTIALS" || exit 8\n'
        'echo "$GOOGLE_APPLICATION_CREDENTIALS" > "$5/key-path"\n',
    )
    env = {"PATH": f"{tmp_path / 'bin'}:{SYSTEM_PATH}", dl.GCS_KEY_VAR: '{"type": "service_account"}'}
    dest = tmp_path / "d"
    assert dl.download(dl.parse_source("gs://b/p"), dest, None, env=env) is True
    key_path = (dest / "key-path").read_text().strip()
    assert not os.path.exists(key_path)  # removed after the copy


def test_gs_without_a_cli_says_what_to_install(tmp_path):
    with pytest.raises(dl.DownloadError, match=r"needs the gcloud CLI \(or gsutil\) in the image"):
        dl.download(dl.parse_source("gs://b/p"), tmp_path, None, env={"PATH": str(tmp_path)})


def test_waiting_polls_for_the_marker_and_says_so_each_minute(tmp_path):
    source, now, logs = dl.parse_source("hf://org/name"), [0.0], []

    def sleep(seconds):
        now[0] += seconds
        if now[0] >= 150:
            (tmp_path / dl.MARKER).write_text(json.dumps({"source": str(source), "revision": None}))

    dl.wait_until_complete(tmp_path, source, None, sleep=sleep, clock=lambda: now[0], log=logs.append)
    assert now[0] == 150 and len(logs) == 2 and "the download Job writes it" in logs[0]
    with pytest.raises(dl.DownloadError, match="did not appear"):
        dl.wait_until_complete(tmp_path / "x", source, None, sleep=sleep, clock=lambda: now[0], timeout=30)


def test_adapters_come_after_the_model_and_are_waited_for_alike(tmp_path, monkeypatch):
    fetched = []

    def snapshot_download(**kwargs):
        fetched.append((kwargs["repo_id"], kwargs["revision"]))
        Path(kwargs["local_dir"], "weights.safetensors").write_bytes(b"w")
        return kwargs["local_dir"]

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    model, sql = tmp_path / "org" / "name@v2", tmp_path / "adapters" / "sql"
    args = ["download", "hf://org/name", str(model), "--revision", "v2", "--adapter", "org/sql-lora", str(sql)]
    assert main(args) == 0
    assert fetched == [("org/name", "v2"), ("org/sql-lora", None)]  # the adapter has no pin of its own
    assert dl.is_complete(sql, dl.parse_source("org/sql-lora"), None)
    assert main([*args, "--wait"]) == 0  # a pod waiting for the Job returns once both are in
    assert len(fetched) == 2


def test_the_cli_refuses_an_unknown_source(capsys):
    with pytest.raises(SystemExit) as info:
        main(["download", "ftp://x/y", "/tmp/never"])
    assert info.value.code == 2
    assert "source='ftp://x/y' is not allowed" in capsys.readouterr().err


HUB_FILES = {"config.json": b"{}", "model.safetensors": b"w" * 64}
HUB_SHA = "c0ffee" * 6 + "c0ff"


class FakeHub(BaseHTTPRequestHandler):
    """The Hub endpoints snapshot_download calls, for one repository ``org/name`` at revision ``v1``."""

    requests: list[tuple[str, str]] = []

    def log_message(self, *args) -> None:
        pass

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        self.requests.append((self.command, self.path))
        path = self.path.split("?")[0]
        if path == "/api/models/org/name/revision/v1":
            siblings = [{"rfilename": name} for name in HUB_FILES]
            return self._json({"id": "org/name", "sha": HUB_SHA, "siblings": siblings})
        if path.startswith("/api/models/org/name/revision/"):
            return self._send(404, b'{"error": "Invalid rev id"}', {"X-Error-Code": "RevisionNotFound"})
        if path == f"/api/models/org/name/tree/{HUB_SHA}":
            files = [
                {"type": "file", "path": n, "size": len(d), "oid": hashlib.sha1(d).hexdigest()}
                for n, d in HUB_FILES.items()
            ]
            return self._json(files)
        name = path.rsplit("/", 1)[-1]
        if path.startswith(f"/org/name/resolve/{HUB_SHA}/") and name in HUB_FILES:
            data = HUB_FILES[name]
            return self._send(200, data, {"X-Repo-Commit": HUB_SHA, "ETag": f'"{hashlib.sha1(data).hexdigest()}"'})
        self._send(404, b'{"error": "not here"}')

    def _json(self, value) -> None:
        self._send(200, json.dumps(value).encode(), {"Content-Type": "application/json"})

    def _send(self, code: int, body: bytes, headers: dict) -> None:
        self.send_response(code)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


@pytest.fixture()
def fake_hub():
    FakeHub.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    thread.join()


def run_cli(args: list[str], endpoint: str, home: Path) -> subprocess.CompletedProcess:
    # NOTE: a subprocess: huggingface_hub reads HF_ENDPOINT once, when it is imported.
    env = {**os.environ, "HF_ENDPOINT": endpoint, "HF_HOME": str(home), "HF_HUB_DISABLE_TELEMETRY": "1"}
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("HF_TOKEN", None)
    command = [sys.executable, "-m", "pagedllm.server.entrypoints.cli", "download", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)


def test_the_hub_client_downloads_the_pinned_revision_from_a_loopback_hub(fake_hub, tmp_path):
    dest = tmp_path / "models" / "org" / "name@v1"
    result = run_cli(["hf://org/name", str(dest), "--revision", "v1"], fake_hub, tmp_path / "hf")
    assert result.returncode == 0, result.stderr
    assert {p.name: p.read_bytes() for p in dest.iterdir() if p.is_file() and p.name != dl.MARKER} == HUB_FILES
    assert dl.is_complete(dest, dl.parse_source("hf://org/name"), "v1")
    assert ("GET", "/api/models/org/name/revision/v1") in FakeHub.requests
    fetched = [path for method, path in FakeHub.requests if method == "GET" and "/resolve/" in path]
    assert sorted(fetched) == sorted(f"/org/name/resolve/{HUB_SHA}/{name}" for name in HUB_FILES)

    FakeHub.requests.clear()  # a second run finds the marker and asks the Hub nothing
    again = run_cli(["hf://org/name", str(dest), "--revision", "v1"], fake_hub, tmp_path / "hf")
    assert again.returncode == 0 and "was already in" in again.stderr and FakeHub.requests == []


def test_an_unknown_hub_revision_is_a_clear_error(fake_hub, tmp_path):
    result = run_cli(["hf://org/name", str(tmp_path / "d"), "--revision", "v9"], fake_hub, tmp_path / "hf")
    assert result.returncode == 2
    assert "pagedllm download: error: hf://org/name has no revision 'v9'" in result.stderr
    assert not (tmp_path / "d" / dl.MARKER).exists()
