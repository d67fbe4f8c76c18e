"""What a cluster admin allows ``PagedLLM`` resources to use: images, service accounts,
priority classes, runtime classes (operator flags ``--allowed-*``, chart ``policy.*``).

An empty list allows anything, except for service accounts: a pod's service account carries
its identity (image pull secrets, a cloud role bound through workload identity), so by
default a resource may run as its namespace's ``default`` account only (spec.serviceAccountName
unset or ``default``); ``--allowed-service-account`` names each other one it may use.

Images match by pattern (``fnmatch``: ``ghcr.io/pagedllm/*`` allows every image under that
repository path, ``*`` any text including ``/`` and ``:``);
the other names match exactly. A resource asking for something not allowed is not
applied: it is ``Degraded`` with reason ``NotAllowed``, naming the field, its value and
the allowed list; what runs already keeps running, as with any spec the operator refuses.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator
from dataclasses import dataclass

from pagedllm.operator.spec import PagedLLMSpec
from pagedllm.operator.status import Problem

NOT_ALLOWED = "NotAllowed"
DEFAULT_SERVICE_ACCOUNT = "default"


@dataclass(frozen=True)
class AdminPolicy:
    """Allow-lists, each empty for no restriction."""

    images: tuple[str, ...] = ()
    """Image patterns the server and endpoint picker containers may run."""
    service_accounts: tuple[str, ...] = ()
    """Names spec.serviceAccountName may take besides ``default`` (unset is the namespace's default)."""
    priority_classes: tuple[str, ...] = ()
    """Names spec.priorityClassName may take (unset is always allowed)."""
    runtime_classes: tuple[str, ...] = ()
    """Names spec.runtimeClassName may take (unset is always allowed)."""

    def check(self, spec: PagedLLMSpec, default_image: str, picker_image: str) -> Problem | None:
        """The first field of ``spec`` the policy does not allow, as a ``NotAllowed`` problem."""
        for path, value, allowed, match in self._asked(spec, default_image, picker_image):
            if allowed and not any(match(value, pattern) for pattern in allowed):
                return Problem(
                    NOT_ALLOWED,
                    f"{path}={value!r} is not allowed by the cluster's policy: allowed are {list(allowed)}",
                )
        return None

    def _asked(self, spec: PagedLLMSpec, default_image: str, picker_image: str) -> Iterator[tuple]:
        yield (
            ("spec.image" if spec.image else "the operator's default image"),
            (spec.image or default_image),
            self.images,
            fnmatch.fnmatchcase,
        )
        routing = spec.routing
        if routing.inference_pool and routing.deploy_picker:
            path = "spec.routing.endpointPicker.image" if routing.picker_image else "the default endpoint picker image"
            yield path, routing.picker_image or picker_image, self.images, fnmatch.fnmatchcase
        accounts = (DEFAULT_SERVICE_ACCOUNT, *(a for a in self.service_accounts if a != DEFAULT_SERVICE_ACCOUNT))
        for path, value, allowed in (
            ("spec.serviceAccountName", spec.service_account_name, accounts),
            ("spec.priorityClassName", spec.priority_class_name, self.priority_classes),
            ("spec.runtimeClassName", spec.runtime_class_name, self.runtime_classes),
        ):
            if value is not None:
                yield path, value, allowed, str.__eq__
