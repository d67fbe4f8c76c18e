"""Applying a rendering: each child on its own, so one refusal never blocks the others.

A claim whose immutable fields changed (the API answers 422), a kind the operator may
not write (403) or a same-named object that another controller owns is reported and
skipped; the Deployment and Service are still applied. What went wrong comes back as
data (:class:`ApplyOutcome`), for the handlers to turn into a condition or a retry.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from pagedllm.operator.drift import foreign_controller
from pagedllm.operator.kube import ApiError
from pagedllm.operator.status import Problem

APPLY_REFUSED = "ApplyRefused"
ADOPTION_REFUSED = "AdoptionRefused"
REFUSALS = (APPLY_REFUSED, ADOPTION_REFUSED)


class Kube(Protocol):
    async def get(self, kind: str, namespace: str, name: str, api_version: str | None = None) -> dict | None: ...

    async def apply(self, manifest: Mapping[str, Any]) -> dict: ...


@dataclass
class ApplyOutcome:
    """What one pass over the rendering did."""

    applied: dict[str, dict] = field(default_factory=dict)
    """kind -> the object as the API server answered the apply."""
    refused: list[Problem] = field(default_factory=list)
    """Children the operator cannot apply until something changes (spec, RBAC, the other owner)."""
    transient: list[str] = field(default_factory=list)
    """Children whose apply failed for a reason that may pass (conflict, throttling, 5xx)."""

    def problem(self) -> Problem | None:
        """All refusals as one ``Degraded`` reason and message; ``None`` if there were none."""
        if not self.refused:
            return None
        message = "; ".join(p.message for p in self.refused)
        if self.transient:
            message += "; retrying: " + "; ".join(self.transient)
        return Problem(self.refused[0].reason, message)


async def apply_all(manifests: Iterable[Mapping[str, Any]], kube: Kube, owner_uid: str | None) -> ApplyOutcome:
    """Apply each manifest, whatever the others did; the Deployment last.

    NOTE: its pods then start only once what they use (the claim, the Service) exists, and
    the status the caller reads right after is as fresh as it can be.
    """
    outcome = ApplyOutcome()
    for manifest in sorted(manifests, key=lambda m: m["kind"] == "Deployment"):
        kind, meta = manifest["kind"], manifest["metadata"]
        what = f"{kind} {meta['name']}"
        try:
            live = await kube.get(kind, meta["namespace"], meta["name"], api_version=manifest["apiVersion"])
            other = foreign_controller(live, owner_uid)
            if other is not None:
                outcome.refused.append(
                    Problem(ADOPTION_REFUSED, f"{what} already exists and is controlled by {other}: not taking it over")
                )
                continue
            outcome.applied[kind] = await kube.apply(manifest)
        except ApiError as exc:
            if exc.retriable:
                outcome.transient.append(f"{what}: {exc}")
            else:
                outcome.refused.append(Problem(APPLY_REFUSED, f"{what}: {exc.message}"))
    return outcome
