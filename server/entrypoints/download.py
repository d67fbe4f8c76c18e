"""``pagedllm download``: put a model's files in a directory once, or wait until they are there.

Sources::

    hf://ORG/NAME   (or a bare ORG/NAME)   the Hugging Face Hub, through huggingface_hub;
                                           --revision pins a commit, tag or branch
    s3://BUCKET/PREFIX                     the aws CLI (`aws s3 sync`)
    gs://BUCKET/PREFIX                     the gcloud CLI (`gcloud storage rsync`), else gsutil

Credentials come from the environment (the operator fills it from the Secret named in
``spec.modelSource.credentialsSecret``): ``HF_TOKEN``; ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` (or a pod role: IRSA, Pod Identity); for gs a key file's JSON in
``GCS_SERVICE_ACCOUNT_JSON`` (or Workload Identity). A missing tool or a refusal is an
error that says what to install or which credential to provide.

NOTE: ``DEST/.pagedllm-complete`` is written last, naming source and revision. Its presence
means the files are whole: a download cut short leaves no marker and runs again (each tool
resumes), and ``--wait`` (the server pods sharing a cache that one Job fills) waits for it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

MARKER = ".pagedllm-complete"
SCHEMES = ("hf", "s3", "gs")
WAIT_POLL_SECONDS = 5.0
WAIT_LOG_SECONDS = 60.0
AWS_CREDENTIAL_VARS = (
    "AWS_ACCESS_KEY_ID",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_PROFILE",
)
GCS_KEY_VAR = "GCS_SERVICE_ACCOUNT_JSON"


class DownloadError(ValueError):
    """A download that cannot succeed as asked; the message says what to change."""


@dataclass(frozen=True)
class Source:
    """Where the files come from: a scheme of :data:`SCHEMES` and what follows ``scheme://``."""

    scheme: str
    location: str

    def __str__(self) -> str:
        return f"{self.scheme}://{self.location}"


def parse_source(text: str) -> Source:
    """``hf://org/name``, ``s3://bucket/prefix``, ``gs://bucket/prefix``, or a bare Hub id."""
    scheme, sep, location = text.partition("://")
    if not sep:
        scheme, location = "hf", text
    location = location.strip("/")
    if scheme not in SCHEMES or not location or ".." in location.split("/"):
        raise DownloadError(
            f"source={text!r} is not allowed: use hf://ORG/NAME (or ORG/NAME), s3://BUCKET/PREFIX or gs://BUCKET/PREFIX"
        )
    return Source(scheme, location)


def is_complete(dest: Path, source: Source, revision: str | None) -> bool:
    """Whether ``dest`` holds the whole download of ``source`` at ``revision``."""
    try:
        recorded = json.loads((dest / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return recorded == {"source": str(source), "revision": revision}


Fetcher = Callable[[Source, Path, "str | None", Mapping[str, str]], None]


def download(
    source: Source,
    dest: Path,
    revision: str | None,
    *,
    fetchers: Mapping[str, Fetcher] | None = None,
    env: Mapping[str, str] | None = None,
) -> bool:
    """Fetch ``source`` into ``dest`` unless already there; True if it fetched."""
    if revision is not None and source.scheme != "hf":
        raise DownloadError(f"--revision={revision!r} is not allowed with {source}: only hf:// sources have revisions")
    if is_complete(dest, source, revision):
        return False
    dest.mkdir(parents=True, exist_ok=True)
    (dest / MARKER).unlink(missing_ok=True)
    fetch = (fetchers or FETCHERS)[source.scheme]
    fetch(source, dest, revision, os.environ if env is None else env)
    (dest / MARKER).write_text(json.dumps({"source": str(source), "revision": revision}))
    return True


def wait_until_complete(
    dest: Path,
    source: Source,
    revision: str | None,
    *,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    log: Callable[[str], None] = print,
    timeout: float | None = None,
) -> None:
    """Return once ``dest`` holds ``source`` (written by another process); no timeout by default."""
    start = last_log = clock()
    while not is_complete(dest, source, revision):
        now = clock()
        if timeout is not None and now - start >= timeout:
            raise DownloadError(f"{source} did not appear in {dest} within {timeout:.0f} s")
        if now - last_log >= WAIT_LOG_SECONDS:
            log(f"waiting for {source} in {dest} ({now - start:.0f} s so far; the download Job writes it)")
            last_log = now
        sleep(WAIT_POLL_SECONDS)


def fetch_hf(source: Source, dest: Path, revision: str | None, env: Mapping[str, str]) -> None:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (
            GatedRepoError,
            HfHubHTTPError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError as exc:
        raise DownloadError(f"{source} needs huggingface_hub in the image: pip install huggingface_hub") from exc
    token_hint = "" if env.get("HF_TOKEN") else " HF_TOKEN is not set: give one through hfTokenSecret."
    try:
        snapshot_download(
            repo_id=source.location, revision=revision, local_dir=str(dest), ignore_patterns=["original/*"]
        )
    except RevisionNotFoundError as exc:
        raise DownloadError(f"{source} has no revision {revision!r}: {exc}") from exc
    except (GatedRepoError, RepositoryNotFoundError) as exc:
        raise DownloadError(f"{source} could not be read (missing, private or gated):{token_hint} {exc}") from exc
    except (HfHubHTTPError, LocalEntryNotFoundError) as exc:
        raise DownloadError(f"{source} could not be downloaded from the Hub: {exc}") from exc


def fetch_s3(source: Source, dest: Path, revision: str | None, env: Mapping[str, str]) -> None:
    aws = _tool(env, "aws", source, "the aws CLI (awscli)")
    hint = (
        ""
        if any(env.get(var) for var in AWS_CREDENTIAL_VARS)
        else "; no AWS credentials in the environment (none of "
        + ", ".join(AWS_CREDENTIAL_VARS)
        + "): name a Secret with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in spec.modelSource.credentialsSecret, "
        "or give the pods an IAM role"
    )
    _run([aws, "s3", "sync", f"s3://{source.location}", str(dest), "--only-show-errors"], source, env, hint)


def fetch_gs(source: Source, dest: Path, revision: str | None, env: Mapping[str, str]) -> None:
    gcloud = shutil.which("gcloud", path=env.get("PATH"))
    command = (
        [gcloud, "storage", "rsync", "--recursive", f"gs://{source.location}", str(dest)]
        if gcloud
        else [_tool(env, "gsutil", source, "the gcloud CLI (or gsutil)"), "-m", "rsync", "-r"]
        + [f"gs://{source.location}", str(dest)]
    )
    env = dict(env)
    key = env.pop(GCS_KEY_VAR, None)
    hint = (
        ""
        if key or env.get("GOOGLE_APPLICATION_CREDENTIALS")
        else f"; no {GCS_KEY_VAR} or GOOGLE_APPLICATION_CREDENTIALS in the environment: name a Secret with "
        f"{GCS_KEY_VAR} (a service account key's JSON) in spec.modelSource.credentialsSecret, or use Workload Identity"
    )
    with tempfile.TemporaryDirectory() as scratch:
        if key:
            key_file = Path(scratch) / "key.json"
            key_file.write_text(key)
            env["GOOGLE_APPLICATION_CREDENTIALS"] = env["CLOUDSDK_AUTH_CREDENTIAL_FILE_OVERRIDE"] = str(key_file)
        _run(command, source, env, hint)


def _tool(env: Mapping[str, str], name: str, source: Source, what: str) -> str:
    found = shutil.which(name, path=env.get("PATH"))
    if found is None:
        raise DownloadError(f"{source} needs {what} in the image, and `{name}` is not on PATH: install it")
    return found


def _run(command: list[str], source: Source, env: Mapping[str, str], hint: str) -> None:
    result = subprocess.run(command, env=dict(env), capture_output=True, text=True)
    if result.returncode != 0:
        said = (result.stderr or result.stdout).strip()[-1500:]
        raise DownloadError(
            f"{source} could not be copied ({Path(command[0]).name} exit {result.returncode}): {said}{hint}"
        )


FETCHERS: Mapping[str, Fetcher] = {"hf": fetch_hf, "s3": fetch_s3, "gs": fetch_gs}


def add_download_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "download",
        help="Put a model's files in a directory (hf://, s3://, gs://), once; or wait for them.",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        allow_abbrev=False,
    )
    p.add_argument("source", help="hf://ORG/NAME (or ORG/NAME), s3://BUCKET/PREFIX or gs://BUCKET/PREFIX.")
    p.add_argument("dest", help="Directory the files go into.")
    p.add_argument("--revision", default=None, help="Hub commit, tag or branch (hf:// only; default: main).")
    p.add_argument("--wait", action="store_true", help="Only wait until another process has put the files there.")
    p.add_argument(
        "--adapter",
        nargs=2,
        action="append",
        default=[],
        metavar=("SOURCE", "DEST"),
        help="Also fetch (or wait for) a LoRA adapter from SOURCE into DEST, after the model; repeatable.",
    )
    p.set_defaults(func=run_download)
    return p


ADAPTERS_ENV = "PAGEDLLM_ADAPTER_DOWNLOADS"
"""Whitespace-separated SOURCE DEST pairs fetched (or waited for) like --adapter, after those."""


def adapters_from_env() -> list[tuple[str, str]]:
    words = os.environ.get(ADAPTERS_ENV, "").split()
    if len(words) % 2:
        raise SystemExit(f"${ADAPTERS_ENV}={' '.join(words)!r} is not SOURCE DEST pairs")
    return list(zip(words[::2], words[1::2]))


def run_download(args: argparse.Namespace) -> int:
    adapters = [*args.adapter, *adapters_from_env()]
    pairs = [(args.source, args.dest, args.revision)] + [(src, dest, None) for src, dest in adapters]
    for text, where, revision in pairs:
        source, dest = parse_source(text), Path(where)
        if args.wait:
            wait_until_complete(dest, source, revision)
            print(f"{source} is in {dest}")
            continue
        fetched = download(source, dest, revision)
        print(f"{source} {'downloaded into' if fetched else 'was already in'} {dest}", file=sys.stderr)
    return 0
    fetched = download(source, dest, args.revision)
    print(f"{source} {'downloaded into' if fetched else 'was already in'} {dest}", file=sys.stderr)
    return 0
