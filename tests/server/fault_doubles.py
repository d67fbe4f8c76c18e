"""Test doubles of the worker that inject faults: the engine and the workers carry no fault hooks.

Tests run every rank as :class:`FaultyWorker` (``worker_cls=WORKER``, or ``--worker-cls``) and
give its rules in ``PAGEDLLM_INJECT_FAULTS``, so they reach every process a test starts (the
engine-core process, other tensor-parallel ranks, other nodes). Comma-separated rules:

    request=SUBSTR   rank 0 returns tokens output processing cannot read, for requests whose id contains SUBSTR
    sampler=SUBSTR   rank 0's sampler raises while a request whose id contains SUBSTR is in its batch
    step=N           the Nth model step raises on rank 0 (1 and 2 are the warm-up's steps)
    step=N+          every model step from the Nth raises
    die=R / hang=R   rank R exits with code 3 / hangs in its first step

    PAGEDLLM_INJECT_FAULTS='request=poison' pagedllm serve --worker-cls tests.server.fault_doubles:FaultyWorker
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from pagedllm.server.config import ConfigError
from pagedllm.server.core.scheduler_output import SchedulerOutput
from pagedllm.server.worker.model_runner import ModelRunner
from pagedllm.server.worker.model_step import LaunchedStep, StepOutputs
from pagedllm.server.worker.sampler import Sampler
from pagedllm.server.worker.sampling_batch import RowSampling

FAULTS_ENV = "PAGEDLLM_INJECT_FAULTS"
WORKER = "tests.server.fault_doubles:FaultyWorker"
RULES = ("request", "sampler", "step", "die", "hang")


class InjectedFault(RuntimeError):
    """Raised where a rule says so; nothing else raises it."""


@dataclass(frozen=True)
class Faults:
    request: str | None = None
    sampler: str | None = None
    first_step: int | None = None
    every_step_after: bool = False
    die_rank: int | None = None
    hang_rank: int | None = None

    @classmethod
    def parse(cls, text: str) -> Faults:
        rules = dict(part.split("=", 1) for part in text.split(",") if "=" in part)
        if not rules or set(rules) - set(RULES):
            raise ConfigError(FAULTS_ENV, text, "comma-separated " + ", ".join(f"{r}=..." for r in RULES))
        step, die, hang = rules.get("step"), rules.get("die"), rules.get("hang")
        return cls(
            rules.get("request"),
            rules.get("sampler"),
            int(step.rstrip("+")) if step else None,
            bool(step and step.endswith("+")),
            int(die) if die else None,
            int(hang) if hang else None,
        )

    def step_fails(self, step: int) -> bool:
        if self.first_step is None:
            return False
        return step == self.first_step or (self.every_step_after and step > self.first_step)


class PoisonedTokens:
    """A row's tokens that raise when output processing reads them."""

    def __init__(self, request_id: str) -> None:
        self._request_id = request_id

    def __getattr__(self, name: str) -> Any:
        raise InjectedFault(f"injected fault in output processing of {self._request_id}")


class PoisonSampler(Sampler):
    """Raises while a poisoned request is among the rows it draws (as a sampler bug would)."""

    def __init__(self, seed: int, device: torch.device, poison: str) -> None:
        super().__init__(seed, device)
        self.poison = poison

    def _draw(self, logits: torch.Tensor, rows: list[RowSampling], drawn: list[int]) -> torch.Tensor:
        if any(self.poison in rows[k].request_id for k in drawn):
            raise InjectedFault("injected fault in the sampler")
        return super()._draw(logits, rows, drawn)


class FaultyWorker(ModelRunner):
    """The model runner, failing where ``PAGEDLLM_INJECT_FAULTS`` says."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.faults = Faults.parse(os.environ[FAULTS_ENV])
        self.num_steps = 0
        if self.sampler is not None and self.faults.sampler:
            self.sampler = PoisonSampler(self.config.model.seed, self.device, self.faults.sampler)

    def execute(self, model_step: SchedulerOutput) -> StepOutputs:
        self._before_step()
        return self._poison(super().execute(model_step), model_step)

    def launch(self, model_step: SchedulerOutput) -> LaunchedStep:
        """The step as ``async_scheduling`` runs it: the faults come where :meth:`execute` has them."""
        self._before_step()
        launched = super().launch(model_step)
        return LaunchedStep(lambda: self._poison(launched.outputs(), model_step).sampled, launched.pooled)

    def _before_step(self) -> None:
        self.num_steps += 1
        if self.faults.die_rank == self.tp.rank:
            os._exit(3)
        if self.faults.hang_rank == self.tp.rank:
            time.sleep(3600)
        if self.tp.rank == 0 and self.faults.step_fails(self.num_steps):
            raise InjectedFault(f"injected fault in model step {self.num_steps}")

    def _poison(self, outputs: StepOutputs, model_step: SchedulerOutput) -> StepOutputs:
        poison, sampled, batch = self.faults.request, outputs.sampled, model_step.sampling
        if poison and sampled is not None and batch is not None:
            for i, row in enumerate(batch.rows[: len(sampled.rows)]):
                if poison in row.request_id and sampled.rows[i] is not None:
                    sampled.rows[i] = PoisonedTokens(row.request_id)  # type: ignore[call-overload]
        return outputs
