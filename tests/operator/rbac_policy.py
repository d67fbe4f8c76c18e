"""RBAC for the emulated API server: the chart's rendered roles decide what the operator may do.

:class:`RbacPolicy` holds the rules bound to one service account by the (Cluster)Roles and
(Cluster)RoleBindings of ``helm template`` output, and answers whether a request's
attributes (verb, API group, resource[/subresource], namespace, name) are allowed, the
way the API server's RBAC authorizer does: a ClusterRoleBinding grants its rules in every
namespace and on cluster-scoped resources, a RoleBinding only in its own namespace; ``*``
matches any group, resource or verb; ``resourceNames`` limit a rule to those objects (never
to ``create``, ``list``, ``watch`` or ``deletecollection``, which name no object).
Discovery and other non-resource URLs are open to every authenticated user, as the
default ``system:discovery`` binding makes them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Attributes:
    """What RBAC looks at in a request."""

    verb: str
    group: str
    resource: str  # "pagedllms" or "pagedllms/status"
    namespace: str | None
    name: str | None

    def as_verb(self, verb: str) -> Attributes:
        return replace(self, verb=verb)


def verb_of(method: str, action: str, named: bool) -> str:
    """The RBAC verb of an HTTP request (``action`` is kmock's: list, watch, fetch, ...)."""
    if action == "watch":
        return "watch"
    return {
        "GET": "get" if named else "list",
        "POST": "create",
        "PUT": "update",
        "PATCH": "patch",
        "DELETE": "delete" if named else "deletecollection",
    }.get(method, method.lower())


def _matches(rule: dict, attrs: Attributes) -> bool:
    groups, resources, verbs = rule.get("apiGroups") or [], rule.get("resources") or [], rule.get("verbs") or []
    if not ({"*", attrs.group} & set(groups) and {"*", attrs.verb} & set(verbs)):
        return False
    plural, _, sub = attrs.resource.partition("/")
    wanted = {"*", attrs.resource} | ({f"*/{sub}"} if sub else set())
    if not wanted & set(resources):
        return False
    names = rule.get("resourceNames") or []
    return not names or (attrs.name is not None and attrs.name in names)


class RbacPolicy:
    """The rules a set of rendered manifests grants one service account."""

    def __init__(self, docs: list[dict], namespace: str, service_account: str):
        self.subject = (namespace, service_account)
        cluster_roles = {d["metadata"]["name"]: d.get("rules") or [] for d in docs if d["kind"] == "ClusterRole"}
        roles = {
            (d["metadata"].get("namespace"), d["metadata"]["name"]): d.get("rules") or []
            for d in docs
            if d["kind"] == "Role"
        }
        self.cluster_rules: list[dict] = []
        self.namespaced_rules: dict[str, list[dict]] = {}
        for binding in docs:
            if binding["kind"] not in ("ClusterRoleBinding", "RoleBinding") or not self._binds(binding):
                continue
            ref = binding["roleRef"]
            if binding["kind"] == "ClusterRoleBinding":
                self.cluster_rules += cluster_roles.get(ref["name"], [])
                continue
            ns = binding["metadata"].get("namespace")
            rules = cluster_roles.get(ref["name"], []) if ref["kind"] == "ClusterRole" else roles.get((ns, ref["name"]))
            self.namespaced_rules.setdefault(ns, []).extend(rules or [])

    @classmethod
    def of_chart(cls, docs: list[dict], namespace: str) -> RbacPolicy:
        """The policy of the chart's own service account (``helm template --namespace NAMESPACE``)."""
        (account,) = [d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount"]
        return cls(docs, namespace, account)

    def _binds(self, binding: dict) -> bool:
        namespace, name = self.subject
        return any(
            s.get("kind") == "ServiceAccount" and s.get("name") == name and s.get("namespace") == namespace
            for s in binding.get("subjects") or []
        )

    def allows(self, attrs: Attributes) -> bool:
        rules = self.cluster_rules + (self.namespaced_rules.get(attrs.namespace, []) if attrs.namespace else [])
        return any(_matches(rule, attrs) for rule in rules)

    def refusal(self, attrs: Attributes) -> str:
        """The API server's message for a request the policy does not allow."""
        namespace, account = self.subject
        plural = attrs.resource.split("/")[0]
        what = f"{plural}.{attrs.group}" if attrs.group else plural
        target = f' "{attrs.name}"' if attrs.name else ""
        where = f'in the namespace "{attrs.namespace}"' if attrs.namespace else "at the cluster scope"
        return (
            f'{what}{target} is forbidden: User "system:serviceaccount:{namespace}:{account}" cannot '
            f'{attrs.verb} resource "{attrs.resource}" in API group "{attrs.group}" {where}'
        )
