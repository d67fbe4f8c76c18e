"""How a resource's pods are replaced when its spec changes: the Deployment's strategy.

    one replica              Recreate (stop the old pod, then start the new one)
    a fleet                  RollingUpdate, maxSurge 0, maxUnavailable 1
    spec.rollout             RollingUpdate with the given maxSurge / maxUnavailable

A ``spec.rollout`` with one bound leaves the other at what keeps the pair able to replace
pods: ``maxSurge: 0`` alone means ``maxUnavailable: 1``, ``maxUnavailable: 0`` alone means
``maxSurge: 1``, and a non-zero one alone leaves the other 0.

A fleet (replicas > 1, or autoscaled) rolls one pod at a time without extra GPUs: each
replica holds whole GPUs, and a cluster rarely keeps a spare replica's worth idle, so a
surge pod would sit Pending and stall the rollout. ``maxSurge: 1`` (or more) is for
clusters that have them. One replica has nothing to roll through, so it is recreated,
unless ``rolloutStrategy: RollingUpdate`` asks to start the new pod first (``maxSurge 1``,
``maxUnavailable 0``: no downtime, one replica's GPUs spare).

Refused, with the value and the reason:

- ``maxSurge`` > 0 with a ReadWriteOnce model cache: the surge pod may be scheduled on
  another node, where the claim cannot attach (Multi-Attach), and the rollout hangs.
- ``maxSurge`` 0 with ``maxUnavailable`` 0: nothing could ever be replaced (the API
  refuses it too).
- ``spec.rollout`` with ``rolloutStrategy: Recreate``: Recreate has no surge or budget.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pagedllm.operator.spec_fields import SpecError, _mapping

IntOrPercent = int | str
_PERCENT_RE = re.compile(r"^(0|[1-9][0-9]*)%$")

RECREATE, ROLLING = "Recreate", "RollingUpdate"
FLEET_DEFAULT: tuple[IntOrPercent, IntOrPercent] = (0, 1)
SINGLE_ROLLING_DEFAULT: tuple[IntOrPercent, IntOrPercent] = (1, 0)


@dataclass(frozen=True)
class Rollout:
    """``spec.rollout``: a Deployment's rolling-update bounds; unset ones take the defaults."""

    max_surge: IntOrPercent | None = None
    """Pods above the desired count during a rollout: a count, or a percent of the replicas (rounded up)."""
    max_unavailable: IntOrPercent | None = None
    """Desired pods that may be down during a rollout: a count, or a percent (rounded down)."""


def _int_or_percent(path: str, value: Any) -> IntOrPercent:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and _PERCENT_RE.match(value) and int(value[:-1]) <= 100:
        return value
    raise SpecError(
        f"{path}={value!r} is not allowed: a count >= 0 or a percentage from '0%' to '100%', e.g. 1 or '25%'"
    )


def parse_rollout(path: str, value: Any) -> Rollout:
    value = _mapping(path, value)
    unknown = sorted(set(value) - {"maxSurge", "maxUnavailable"})
    if unknown:
        raise SpecError(f"{path} has unknown field(s) {unknown}: allowed are ['maxSurge', 'maxUnavailable']")
    surge, unavailable = value.get("maxSurge"), value.get("maxUnavailable")
    return Rollout(
        max_surge=None if surge is None else _int_or_percent(f"{path}.maxSurge", surge),
        max_unavailable=None if unavailable is None else _int_or_percent(f"{path}.maxUnavailable", unavailable),
    )


def is_zero(value: IntOrPercent) -> bool:
    return value in (0, "0%")


@dataclass(frozen=True)
class RolloutPlan:
    """What the Deployment's strategy is made of, after defaults; rendered by :meth:`strategy`."""

    type: str
    max_surge: IntOrPercent = 0
    max_unavailable: IntOrPercent = 1

    def strategy(self) -> dict:
        if self.type == RECREATE:
            return {"type": RECREATE}
        bounds = {"maxSurge": self.max_surge, "maxUnavailable": self.max_unavailable}
        return {"type": ROLLING, "rollingUpdate": bounds}


def _bounds(rollout: Rollout, fleet: bool) -> tuple[IntOrPercent, IntOrPercent]:
    """The given bounds; one left unset makes the pair able to replace pods (a surge of 0 leaves
    maxUnavailable 1, an unavailable of 0 leaves maxSurge 1); both unset take the defaults."""
    surge, unavailable = rollout.max_surge, rollout.max_unavailable
    if surge is None and unavailable is None:
        return FLEET_DEFAULT if fleet else SINGLE_ROLLING_DEFAULT
    if surge is None:
        assert unavailable is not None
        return (1 if is_zero(unavailable) else 0), unavailable
    if unavailable is None:
        return surge, (1 if is_zero(surge) else 0)
    return surge, unavailable


def plan_rollout(strategy: str | None, rollout: Rollout | None, fleet: bool, rwo_cache: bool) -> RolloutPlan:
    """The strategy for ``spec.rolloutStrategy`` / ``spec.rollout``; raise :class:`SpecError` if refused.

    ``fleet``: the resource may run more than one replica; ``rwo_cache``: its pods mount a
    ReadWriteOnce model cache.
    """
    if strategy == RECREATE and rollout is not None:
        raise SpecError(
            "spec.rollout is not allowed with spec.rolloutStrategy='Recreate': Recreate has no maxSurge or "
            "maxUnavailable; remove one of them"
        )
    if strategy == RECREATE or (strategy is None and rollout is None and not fleet):
        return RolloutPlan(RECREATE)
    given = rollout or Rollout()
    surge, unavailable = _bounds(given, fleet)
    if is_zero(surge) and is_zero(unavailable):
        raise SpecError(
            f"spec.rollout.maxSurge={surge!r} is not allowed with maxUnavailable={unavailable!r}: no pod could "
            "ever be replaced; set maxUnavailable to 1 (no spare GPUs needed) or maxSurge to 1"
        )
    if rwo_cache and not is_zero(surge):
        where = "spec.rollout.maxSurge" if given.max_surge is not None else "the RollingUpdate default maxSurge"
        raise SpecError(
            f"{where}={surge!r} is not allowed with a ReadWriteOnce spec.modelCache: a surge pod scheduled on "
            "another node cannot attach the claim (Multi-Attach) and the rollout hangs; set maxSurge to 0, "
            "use rolloutStrategy Recreate, or accessMode ReadWriteMany"
        )
    return RolloutPlan(ROLLING, surge, unavailable)
