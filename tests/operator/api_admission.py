"""What the emulated API server checks before it serves a request: RBAC (403) and the schemas (422).

:class:`Admission` authorizes the operator's requests by its :class:`rbac_policy.RbacPolicy`,
validates, prunes and defaults every write through :class:`api_schemas.ApiSchemas`, and
keeps what it refused for the tests to look at.
"""

from __future__ import annotations

import copy
from typing import Any

import aiohttp.web
import attrs
import kmock
from api_chaos import WatchServing
from api_schemas import ApiSchemas, SchemaError
from kmock._internal import dicts as kmock_dicts
from rbac_policy import Attributes, RbacPolicy, verb_of

from pagedllm.operator.kube import APPLY_PATCH

# A test's create with this header skips validation: the object stands for one an older schema admitted.
UNCHECKED_HEADER = "X-Emulator-Unchecked"

# The bearer token of the operator's kubeconfig: requests that carry it are the policy's to allow.
OPERATOR_TOKEN = "operator-service-account"


def merge_patch(old: Any, new: Any) -> Any:
    """The JSON merge patch that turns ``old`` into ``new`` (``None`` deletes a field)."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return copy.deepcopy(new)
    patch = {key: None for key in old if key not in new}
    for key, value in new.items():
        if key not in old or old[key] != value:
            patch[key] = merge_patch(old.get(key), value)
    return patch


@attrs.define(kw_only=True)
class Admission(WatchServing):
    """RBAC for the operator's requests and schema admission of every write."""

    # What the operator's credentials (OPERATOR_TOKEN) may do; None: anything.
    policy: RbacPolicy | None = attrs.field(default=None, init=False)
    # The operator's requests answered 403 by the policy, as "METHOD PATH: why".
    denials: list[str] = attrs.field(factory=list, init=False)
    # Every write is validated against its kind's schema; the refused ones' messages.
    schemas: ApiSchemas = attrs.field(factory=ApiSchemas, init=False)
    invalid_writes: list[str] = attrs.field(factory=list, init=False)

    def _forbidden(self, request: kmock.Request) -> tuple[int, str] | None:
        """403 where the policy does not allow an operator request (an apply that creates needs create too)."""
        if self.policy is None or request.headers.get("Authorization") != f"Bearer {OPERATOR_TOKEN}":
            return None
        if request.resource is None or request.resource.plural is None:
            return None  # discovery
        plural, sub = request.resource.plural, request.subresource
        attrs = Attributes(
            verb_of(str(request.method.value), str(request.action.value) if request.action else "", bool(request.name)),
            request.resource.group or "",
            f"{plural}/{sub}" if sub else plural,
            request.namespace,
            request.name,
        )
        key = (request.resource, request.namespace, request.name)
        creates = key not in self.objects or self.objects[key].deleted
        applies = attrs.verb == "patch" and self._content_type(request).startswith(APPLY_PATCH)
        for wanted in [attrs, attrs.as_verb("create")] if applies and creates else [attrs]:
            if not self.policy.allows(wanted):
                message = self.policy.refusal(wanted)
                self.denials.append(f"{request.method.value} {request.url.path}: {message}")
                return 403, message
        return None

    def _prospective(self, request: kmock.Request) -> dict | None:
        """The object as the patch would leave it (None where there is nothing to patch)."""
        key = (request.resource, request.namespace, request.name)
        if key in self.objects and not self.objects[key].deleted:
            return kmock_dicts.patch_dict(copy.deepcopy(self.objects[key].raw), request.data)
        applies = request.subresource is None and self._content_type(request).startswith(APPLY_PATCH)
        return request.data if applies else None

    def _default(self, request: kmock.Request, data: dict) -> None:
        """``data`` (a create's object) pruned and defaulted in place, as it is stored."""
        try:
            admitted = self.schemas.admit(data, request.params.get("fieldValidation", "Strict"))
        except SchemaError:  # admitted unchecked (_invalid decided): stored as given
            return
        if admitted is not data:
            data.clear()
            data.update(admitted)

    def _default_patch(self, request: kmock.Request) -> None:
        """A patch of ``spec`` made to leave the stored ``spec`` pruned and defaulted."""
        key = (request.resource, request.namespace, request.name)
        if request.subresource is not None or key not in self.objects or self.objects[key].deleted:
            return
        merged = kmock_dicts.patch_dict(copy.deepcopy(self.objects[key].raw), request.data)
        try:
            admitted = self.schemas.admit(merged, request.params.get("fieldValidation", "Strict"))
        except SchemaError:  # an error the stored object already had (ratcheting): left as it is
            return
        if admitted is not merged and "spec" in admitted:
            request.data["spec"] = merge_patch(self.objects[key].raw.get("spec") or {}, admitted["spec"])

    def _invalid(self, request: kmock.Request, obj: dict | None) -> aiohttp.web.Response | None:
        """422 Invalid where ``obj`` breaks its kind's schema (unknown fields, wrong types, missing ones)."""
        if obj is None or request.headers.get(UNCHECKED_HEADER) and request.headers.get("Authorization") is None:
            return None
        try:
            self.schemas.admit(obj, request.params.get("fieldValidation", "Strict"))
        except SchemaError as exc:
            if exc.args[0] == self._stored_error(request):
                return None  # ratcheting: an error the stored object already had (an older schema admitted it)
            kind, name = obj.get("kind", ""), (obj.get("metadata") or {}).get("name", request.name)
            group = request.resource.group if request.resource is not None else ""
            message = f"{kind}.{group}".rstrip(".") + f' "{name}" is invalid: {exc}'
            self.invalid_writes.append(message)
            status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message}
            return aiohttp.web.json_response({**status, "reason": "Invalid", "code": 422}, status=422)
        return None

    def _stored_error(self, request: kmock.Request) -> str | None:
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            return None
        try:
            self.schemas.admit(self.objects[key].raw)
        except SchemaError as exc:
            return exc.args[0]
        return None

    @staticmethod
    def _content_type(request: kmock.Request) -> str:
        return {k.lower(): v for k, v in request.headers.items()}.get("content-type", "")
