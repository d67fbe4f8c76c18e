"""What the emulated API server checks before it serves a request: RBAC (403) and the schemas (422).

:class:`Admission` authorizes the operator's requests by its :class:`rbac_policy.RbacPolicy`,
validates, prunes and defaults every write through :class:`api_schemas.ApiSchemas`, and
keeps what it refused for the tests to look at.
"""

from __future__ import annotations

import copy
import json
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


def field_validation(request: kmock.Request) -> str:
    """The request's ``fieldValidation``: ``Warn`` where it names none, as the API server's default.

    NOTE: kubectl asks for ``Strict``; the operator's client (the ``kubernetes`` package) asks for
    nothing, so an unknown field it writes is dropped with a warning, not refused.
    """
    return request.params.get("fieldValidation") or "Warn"


def warning_header(text: str) -> str:
    """A ``Warning`` header's value as the API server writes it (RFC 7234: code 299, agent ``-``)."""
    return "299 - " + json.dumps(text)


def _remove(data: Any, path: tuple) -> None:
    """Delete the field at ``path`` from a patch body, where the body has it."""
    for part in path[:-1]:
        if isinstance(data, dict) and part in data:
            data = data[part]
        elif isinstance(data, list) and isinstance(part, int) and part < len(data):
            data = data[part]
        else:
            return
    if isinstance(data, dict):
        data.pop(path[-1], None)


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

    def _admit_create(self, request: kmock.Request) -> tuple[aiohttp.web.Response | None, tuple[str, ...]]:
        """A create's object (``request.data``) made what is stored, in place, and its warnings; or a 422."""
        try:
            admitted = self.schemas.admit(request.data, field_validation(request))
        except SchemaError as exc:
            return (None if self._unchecked(request) else self._refuse(request, request.data, exc)), ()
        if admitted.obj is not request.data:
            request.data.clear()
            request.data.update(admitted.obj)
        return None, admitted.warnings

    def _admit_patch(self, request: kmock.Request) -> tuple[aiohttp.web.Response | None, tuple[str, ...]]:
        """A 422 where the patch would leave an invalid object, else its warnings; the unknown fields
        ``fieldValidation`` lets through are taken out of the patch."""
        obj = self._prospective(request)
        if obj is None:
            return None, ()
        try:
            admitted = self.schemas.admit(obj, field_validation(request), old=self._stored(request))
        except SchemaError as exc:
            if exc.args[0] == self._stored_error(request):
                return None, ()  # ratcheting: an error the stored object already had (an older schema admitted it)
            return self._refuse(request, obj, exc), ()
        for path in admitted.dropped:
            _remove(request.data, path)
        return None, admitted.warnings

    def _default_patch(self, request: kmock.Request) -> dict:
        """The object as the patch leaves it, defaulted; the patch made to leave exactly that."""
        key = (request.resource, request.namespace, request.name)
        stored = self.objects[key].raw
        merged = kmock_dicts.patch_dict(copy.deepcopy(stored), request.data)
        if request.subresource is not None:
            return dict(merged)
        try:
            admitted = self.schemas.admit(dict(merged), field_validation(request), old=stored).obj
        except SchemaError:  # an error the stored object already had (ratcheting): left as it is
            return dict(merged)
        request.data.clear()
        request.data.update(merge_patch(stored, admitted))
        return admitted

    def _refuse(self, request: kmock.Request, obj: dict, exc: SchemaError) -> aiohttp.web.Response:
        """422 Invalid, with the API server's message (``Kind.group "name" is invalid: field: why``)."""
        kind, name = obj.get("kind", ""), (obj.get("metadata") or {}).get("name", request.name)
        group = request.resource.group if request.resource is not None else ""
        message = f"{kind}.{group}".rstrip(".") + f' "{name}" is invalid: {exc}'
        self.invalid_writes.append(message)
        status = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message}
        return aiohttp.web.json_response({**status, "reason": "Invalid", "code": 422}, status=422)

    @staticmethod
    def _unchecked(request: kmock.Request) -> bool:
        return bool(request.headers.get(UNCHECKED_HEADER)) and request.headers.get("Authorization") is None

    def _stored(self, request: kmock.Request) -> dict | None:
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            return None
        return self.objects[key].raw

    def _stored_error(self, request: kmock.Request) -> str | None:
        stored = self._stored(request)
        if stored is None:
            return None
        try:
            self.schemas.admit(stored)
        except SchemaError as exc:
            return exc.args[0]
        return None

    @staticmethod
    def _content_type(request: kmock.Request) -> str:
        return {k.lower(): v for k, v in request.headers.items()}.get("content-type", "")
