"""Fault injection: a Runner wrapper that fails, stalls or kills the engine on request (tests only).

    any thread (a test, POST /debug/fault)        engine thread
    FaultInjector.inject(kind, ...) --SimpleQueue-->  FaultInjectingRunner.execute: take, apply, run

The engine thread owns every piece of fault state; the only crossing is the queue (no locks, nothing
rebound at run time). What each kind does, as the engine and its watchdog see it:

    step_error    the next `num_steps` steps raise in the runner: their requests fail, the engine goes on
    stall         the next `num_steps` steps each sleep `seconds` first (a long step: the watchdog trips
                  once one outlasts its timeout)
    no_progress   until `seconds` after injection, the step in flight makes no progress: it waits in
                  short sleeps (a "clear" ends it early) while its requests stay pending
    engine_death  the next step raises EngineDeathInjected, a BaseException: Engine.step fails a step only
                  on Exception, so this one ends the engine loop as a bug in the engine would. An idle
                  engine dies at its next step, when a request arrives.
    clear         drop every fault not yet spent

A newer step fault (step_error, stall) applies first; an older one resumes once the newer is spent.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field

from cobatch.engine import Runner
from cobatch.scheduler_output import RunnerOutput, SchedulerOutput

FAULT_KINDS = ("step_error", "stall", "no_progress", "engine_death", "clear")
_POLL_S = 0.005  # how often a no-progress step looks for a "clear"


class EngineDeathInjected(BaseException):
    """The engine_death fault: not an Exception, so it escapes Engine.step and ends the engine loop."""


@dataclass(frozen=True, slots=True)
class Fault:
    """One injected fault (the module docstring says what each kind does)."""

    kind: str
    seconds: float = 0.0
    num_steps: int = 1
    injected_at: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"kind must be one of {FAULT_KINDS}, got {self.kind!r}")
        if self.seconds < 0.0 or self.num_steps < 1:
            raise ValueError(f"need seconds >= 0 and num_steps >= 1, got {self.seconds}, {self.num_steps}")


class FaultInjector:
    """The thread-safe end: any thread injects; the wrapped runner takes the faults on the engine thread."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Fault] = queue.SimpleQueue()

    def inject(self, kind: str, seconds: float = 0.0, num_steps: int = 1) -> None:
        """Queue a fault for the next step (ValueError for an unknown kind)."""
        self._queue.put(Fault(kind, seconds, num_steps))

    def wrap(self, runner: Runner) -> FaultInjectingRunner:
        """`runner` under this injector's faults: a `wrap_runner` for Engine/AsyncEngine.from_config."""
        return FaultInjectingRunner(runner, self)

    @property
    def has_pending(self) -> bool:
        return not self._queue.empty()

    def take(self) -> list[Fault]:
        """The faults injected since the last call (engine thread)."""
        faults = []
        while True:
            try:
                faults.append(self._queue.get_nowait())
            except queue.Empty:
                return faults


@dataclass(slots=True)
class _StepFault:
    fault: Fault
    num_steps_left: int


class FaultInjectingRunner:
    """A Runner that applies injected faults, then runs the wrapped runner's step."""

    def __init__(self, runner: Runner, injector: FaultInjector | None = None) -> None:
        self.runner = runner
        self.injector = injector if injector is not None else FaultInjector()
        self.num_kv_blocks = runner.num_kv_blocks
        self.num_swap_blocks = runner.num_swap_blocks
        self.max_model_len = runner.max_model_len
        self.eos_token_ids = runner.eos_token_ids
        # Engine-thread state: a stack of step faults, a no-progress deadline, a pending death.
        self._step_faults: list[_StepFault] = []
        self._no_progress_until = 0.0
        self._is_dying = False

    def __getattr__(self, name: str) -> object:
        # Everything else (model_config, dtype, prefault_kv_cache, ...) is the wrapped runner's.
        if name == "runner":  # not set yet (copy, unpickling): no recursion through __getattr__
            raise AttributeError(name)
        return getattr(self.runner, name)

    def inject(self, kind: str, seconds: float = 0.0, num_steps: int = 1) -> None:
        """Queue a fault for the next step (any thread)."""
        self.injector.inject(kind, seconds, num_steps)

    def execute(self, output: SchedulerOutput, **kwargs: object) -> RunnerOutput:
        """Apply the faults due at this step, then run it (kwargs: the runner's, e.g. grammar_bitmask)."""
        if self.injector.has_pending:
            self._take_faults()
        if self._no_progress_until:
            self._wait_out_no_progress()
        if self._is_dying:
            raise EngineDeathInjected("injected fault: the engine loop dies")
        if self._step_faults:
            self._apply_step_fault()
        return self.runner.execute(output, **kwargs)  # type: ignore[call-arg]

    def _take_faults(self) -> None:
        for fault in self.injector.take():
            if fault.kind == "clear":
                self._step_faults.clear()
                self._no_progress_until, self._is_dying = 0.0, False
            elif fault.kind == "engine_death":
                self._is_dying = True
            elif fault.kind == "no_progress":
                self._no_progress_until = fault.injected_at + fault.seconds
            else:
                self._step_faults.append(_StepFault(fault, fault.num_steps))

    def _wait_out_no_progress(self) -> None:
        while time.monotonic() < self._no_progress_until:
            time.sleep(_POLL_S)
            if self.injector.has_pending:
                self._take_faults()
        self._no_progress_until = 0.0

    def _apply_step_fault(self) -> None:
        current = self._step_faults[-1]
        current.num_steps_left -= 1
        if current.num_steps_left == 0:
            self._step_faults.pop()
        if current.fault.kind == "stall":
            time.sleep(current.fault.seconds)
        else:
            raise RuntimeError("injected fault: this step fails")
