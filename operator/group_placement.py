"""``spec.groupPlacement``: where the pods of one multi-node replica (a LeaderWorkerSet group) may run.

With ``exclusiveTopology`` (the default) the LeaderWorkerSet carries
``leaderworkerset.sigs.k8s.io/exclusive-topology: <topologyKey>``: LWS places every pod of a
group in one domain of that node label, and no two groups in the same domain. The group's
collectives then stay inside one zone (or rack, node pool, NVLink clique: whatever the key
names), and one domain going away takes down at most one group.

NOTE: exclusivity also caps the groups at the number of domains: with the default key
``topology.kubernetes.io/zone`` a three-zone cluster runs at most three replicas. Name a finer
key (a node pool, ``nvidia.com/gpu.clique``) or set ``exclusiveTopology: false`` where that is
too few.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedllm.operator.spec_fields import SpecError, _mapping

EXCLUSIVE_TOPOLOGY_ANNOTATION = "leaderworkerset.sigs.k8s.io/exclusive-topology"
DEFAULT_TOPOLOGY_KEY = "topology.kubernetes.io/zone"


@dataclass(frozen=True)
class GroupPlacement:
    exclusive_topology: bool = True
    """One topology domain per group, exclusively (LWS's exclusive-topology annotation)."""
    topology_key: str = DEFAULT_TOPOLOGY_KEY
    """The node label whose values are the domains."""

    def annotations(self) -> dict[str, str]:
        """The LeaderWorkerSet's annotations for this placement."""
        return {EXCLUSIVE_TOPOLOGY_ANNOTATION: self.topology_key} if self.exclusive_topology else {}


def parse_group_placement(path: str, value: Any) -> GroupPlacement:
    value = _mapping(path, value)
    unknown = sorted(set(value) - {"exclusiveTopology", "topologyKey"})
    if unknown:
        raise SpecError(f"{path} has unknown field(s) {unknown}: allowed are ['exclusiveTopology', 'topologyKey']")
    exclusive = value.get("exclusiveTopology", True)
    if not isinstance(exclusive, bool):
        raise SpecError(f"{path}.exclusiveTopology={exclusive!r} has the wrong type: must be a boolean")
    key = value.get("topologyKey", DEFAULT_TOPOLOGY_KEY)
    if not isinstance(key, str) or not key or len(key) > 317 or " " in key:
        raise SpecError(f"{path}.topologyKey={key!r} is not allowed: a node label key, e.g. {DEFAULT_TOPOLOGY_KEY}")
    return GroupPlacement(exclusive, key)
