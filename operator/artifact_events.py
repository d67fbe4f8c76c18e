"""Download Job events -> ``status.model`` of the Job's ``PagedLLM``.

The download of a shared model cache (:mod:`artifacts`) runs for minutes to hours after the
reconcile that created its Job; each change of the Job (a pod started, retried, done) shows
in the owner's ``status.model`` through this handler. Only the Job the current rendering
asks for speaks: an earlier revision's Job finishing late says nothing about the model served now.

NOTE: this handler is the only writer of ``status.model`` (the reconcile's status patches
leave the key alone). A reconcile that wrote it too, from the Job as it applied it, would
race these events: its patch lands after the handler returns, and a download finishing in
between would read ``Downloading`` forever (a complete Job changes no more). kopf sends
every Job once when it starts watching (an operator restart included), so nothing is missed.
"""

from __future__ import annotations

from typing import Any

import kopf

from pagedllm.operator.artifacts import model_status, model_status_patch
from pagedllm.operator.manifests import KIND, render
from pagedllm.operator.spec import SpecError
from pagedllm.operator.status import owner_name

JOBS = ("batch", "v1", "jobs")


async def on_job_event(type: str | None, body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    """An owned download Job changed: write its progress into the owner's ``status.model``."""
    meta = body.get("metadata", {})
    name = owner_name(body)
    if type == "DELETED" or name is None:
        return
    owner = await memo.kube.get(KIND, meta["namespace"], name)
    if owner is None or owner.get("metadata", {}).get("deletionTimestamp"):
        return
    try:
        current = render(owner, memo.config).job
    except SpecError:
        return  # the status already says why nothing is served
    if current is None or current["metadata"]["name"] != meta.get("name"):
        return
    current_status = (owner.get("status") or {}).get("model")
    if current_status != model_status(body):
        patch = model_status_patch(current_status, body)
        logger.info("model download %s: %s", meta.get("name"), patch["phase"])
        await memo.kube.patch_status(KIND, meta["namespace"], name, {"model": patch})
