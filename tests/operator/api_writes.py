"""What the emulated API server does to an object it stores, beyond admission.

:class:`Writes` gives a new object its ``uid``, ``creationTimestamp``, ``resourceVersion``
and ``generation`` (and a name from ``generateName``); refuses a patch that carries a stale
``resourceVersion`` (409); keeps every write's field ownership in ``metadata.managedFields``
(:mod:`field_ownership`), refusing an unforced server-side apply that would take a field
another manager owns (409); creates an object a server-side apply names that does not
exist; bumps ``generation`` when ``spec`` changes; and collects the garbage of a deleted
owner (its dependents, and theirs, as the API server's collector does in the background).
"""

from __future__ import annotations

import copy
import datetime
import uuid

import aiohttp.web
import attrs
import field_ownership
import kmock
from api_admission import Admission
from api_chaos import status_body
from api_schemas import SchemaError

from pagedllm.operator.kube import APPLY_PATCH


def manager_of(request: kmock.Request, applied: bool) -> str:
    """The field manager of a write: ``?fieldManager=``, else what the API server derives."""
    given = request.url.query.get("fieldManager")
    if given:
        return given
    if applied:
        return "kubectl"
    if request.action == kmock.action.CREATE:
        return request.headers.get("User-Agent", "unknown").split("/")[0] or "unknown"
    return "kubectl-edit"


@attrs.define(kw_only=True)
class Writes(Admission):
    """Stamping, optimistic concurrency, field ownership, apply-creates and garbage collection."""

    def _stamp_new(self, data: dict) -> None:
        meta = data.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        meta.setdefault("uid", str(uuid.uuid4()))
        now = datetime.datetime.now(datetime.timezone.utc)
        meta.setdefault("creationTimestamp", now.strftime("%Y-%m-%dT%H:%M:%SZ"))
        meta["generation"] = 1
        meta["resourceVersion"] = self.next_version()

    def _own_created(self, request: kmock.Request) -> None:
        """A create's fields, owned by its manager (an ``Update``, as the API server records a POST)."""
        data = request.data
        keys = self.schemas.list_keys(data.get("apiVersion", ""), data.get("kind", ""))
        entries, _ = field_ownership.record_write(
            None, data, manager_of(request, False), False, data.get("apiVersion", ""), keys
        )
        data["metadata"]["managedFields"] = entries

    def _stale(self, request: kmock.Request) -> dict | None:
        """A 409 Status when the patch carries a resourceVersion that is no longer the object's."""
        given = (request.data.get("metadata") or {}).get("resourceVersion")
        key = (request.resource, request.namespace, request.name)
        if given is None or key not in self.objects or self.objects[key].deleted:
            return None
        current = self.objects[key].raw.get("metadata", {}).get("resourceVersion")
        if str(given) == str(current):
            return None
        message = f"Operation cannot be fulfilled on {request.name}: the object has been modified"
        return status_body(409, message)

    def _applies(self, request: kmock.Request) -> bool:
        return request.subresource is None and self._content_type(request).startswith(APPLY_PATCH)

    def _apply_conflict(self, request: kmock.Request) -> aiohttp.web.Response | None:
        """409 for a server-side apply without ``force`` that sets fields other managers own to other values."""
        stored = self._stored(request)
        if stored is None or not self._applies(request) or request.url.query.get("force") == "true":
            return None
        keys = self.schemas.list_keys(stored.get("apiVersion", ""), stored.get("kind", ""))
        found = field_ownership.conflicts(stored, request.data, manager_of(request, True), keys)
        if not found:
            return None
        using = stored.get("apiVersion", "")
        listed = "; ".join(f'conflict with "{who}" using {using}: {field_ownership.dotted(at)}' for who, at in found)
        message = f"Apply failed with {len(found)} conflict{'s' if len(found) > 1 else ''}: {listed}"
        return aiohttp.web.json_response(status_body(409, message), status=409)

    async def _before_patch(self, request: kmock.Request) -> None:
        """Ownership, resourceVersion, defaults and generation of a patch of an existing object; an
        apply of a missing one creates it."""
        key = (request.resource, request.namespace, request.name)
        old = self._stored(request)
        if old is None:
            if self._applies(request):
                await self._create_by_apply(key, request)
            return
        self._record_owners(request, key)
        request.data.setdefault("metadata", {})["resourceVersion"] = self.next_version()
        new = self._default_patch(request)
        if request.subresource in (None, "scale") and new.get("spec") != old.get("spec"):
            request.data["metadata"]["generation"] = old.get("metadata", {}).get("generation", 1) + 1

    def _record_owners(self, request: kmock.Request, key: tuple) -> None:
        """Field ownership of a write (not of ``/status``); the stored object loses what the write dropped."""
        old = copy.deepcopy(self.objects[key].raw)
        written = field_ownership.tracked(request.data)
        if request.subresource not in (None, "scale") or not written:
            return
        applied = self._applies(request)
        keys = self.schemas.list_keys(old.get("apiVersion", ""), old.get("kind", ""))
        api_version = old.get("apiVersion", "")
        entries, removed = field_ownership.record_write(
            old, written, manager_of(request, applied), applied, api_version, keys
        )
        new = field_ownership.without(old, removed)
        new.setdefault("metadata", {})["managedFields"] = entries
        self.objects[key] = new
        if applied:  # keyed lists merge with the items other managers own
            for name in written.keys() - {"metadata"}:
                request.data[name] = field_ownership.merge_applied(new.get(name), written[name], keys, (name,))

    async def _create_by_apply(self, key: tuple, request: kmock.Request) -> None:
        data = request.data
        self._stamp_new(data)
        api_version = data.get("apiVersion", "")
        keys = self.schemas.list_keys(api_version, data.get("kind", ""))
        entries, _ = field_ownership.record_write(None, data, manager_of(request, True), True, api_version, keys)
        admitted = self._admitted_quietly(data)
        admitted["metadata"]["managedFields"] = entries
        async with self._lock:
            self.objects[key] = copy.deepcopy(admitted)
            await self._buses[key[0]].put({"type": "ADDED", "object": self.objects[key].raw})
        request.data.clear()  # NOTE: stored whole above; kmock's patch after this must not undo the defaults

    def _admitted_quietly(self, data: dict) -> dict:
        """``data`` defaulted (its unknown fields already out); as given where it is invalid (checked before)."""
        try:
            return self.schemas.admit(data, "Ignore").obj
        except SchemaError:  # admission refused it before, unless a test stored it unchecked
            return data

    def _uid_being_deleted(self, request: kmock.Request) -> str | None:
        if request.action != kmock.action.DELETE or request.resource is None or request.name is None:
            return None
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            return None
        return self.objects[key].raw.get("metadata", {}).get("uid")

    async def _collect_garbage(self, owner_uid: str) -> None:
        async with self._lock:
            dependents = [
                (key, obj.raw)
                for key, obj in list(self.objects.items())
                if not obj.deleted
                and any(ref.get("uid") == owner_uid for ref in obj.raw.get("metadata", {}).get("ownerReferences") or [])
            ]
            for key, raw in dependents:
                self.objects[key].delete()
                await self._buses[key[0]].put({"type": "DELETED", "object": raw})
        for _, raw in dependents:
            await self._collect_garbage(raw["metadata"].get("uid"))
