"""Fault injection for tests and development: make one rank fail at a chosen optimizer step.

    DDPEXP_FAULT=rank1:step5:raise          rank 1 raises an exception after its 5th optimizer step
    DDPEXP_FAULT=rank1:step5:kill           rank 1 is killed by SIGKILL there (no Python cleanup runs)
    DDPEXP_FAULT=rank0:step10:kill_in_save  rank 0 is SIGKILLed halfway through writing the step-10
                                            checkpoint (needs a checkpoint at that step)
    DDPEXP_FAULT=rank0:step5:preempt        the job's launcher (the run's own process in-process) gets
                                            SIGUSR1 there, as from Slurm's --signal: with
                                            trainer.checkpoint_on_signal the run saves and stops
    DDPEXP_FAULT=rank1:step5:hang_forward   rank 1's next training forward after step 5 never returns: it
                                            waits forever in the model's first leaf module (a deadlock
                                            in the model's own code), under any strategy
    DDPEXP_FAULT=rank1:step5:hang_backward  the same in its backward: a hook on that module's output
                                            never returns (a gradient hook that deadlocks)

A fault fires in the first attempt only, so a run with dist.max_restarts (or torchrun --max-restarts)
shows the recovery. It comes from the environment (read by pre-flight and RunContext), never from the
config: a fault cannot end up in a saved config, a sweep, or a colleague's rerun. Pre-flight refuses
a malformed one.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import signal
from dataclasses import dataclass

from .errors import UserError

log = logging.getLogger(__name__)

ENV = "DDPEXP_FAULT"
ACTIONS = ("raise", "kill", "kill_in_save", "preempt", "hang_forward", "hang_backward")
HANGS = ("hang_forward", "hang_backward")
_SPEC = re.compile(r"^rank(\d+):step(\d+):(\w+)$")


class InjectedFault(RuntimeError):
    pass


@dataclass(frozen=True)
class Fault:
    rank: int
    step: int
    action: str
    job_pid: int | None = None  # where `preempt` sends its signal

    def after_step(self, step: int) -> None:
        """The engine calls this after every optimizer step (and its checkpoint, if one is due)."""
        if step == self.step and self.action != "kill_in_save":
            self.fire()

    def while_saving(self, step: int) -> None:
        """The checkpointer calls this with half of the step's checkpoint file written."""
        if step == self.step and self.action == "kill_in_save":
            self.fire()

    def fire(self) -> None:
        log.warning("%s: injecting %s on rank %d at step %d", ENV, self.action, self.rank, self.step)
        if self.action == "raise":
            raise InjectedFault(f"injected fault ({ENV}): rank {self.rank} at step {self.step}")
        if self.action == "preempt":
            os.kill(self.job_pid or os.getpid(), signal.SIGUSR1)
            return
        if self.action in HANGS:
            _hang_in_the_model(backward=self.action == "hang_backward")
            return
        for handler in logging.getLogger().handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def _hang_in_the_model(*, backward: bool) -> None:
    """Arm a hang in the next training forward of any module with no children (whatever the strategy
    made of the model, its own leaves still run on the rank that holds them): a global hook, so it
    reaches modules a strategy has wrapped, split or replaced."""
    import threading

    import torch
    from torch.nn.modules import module as nn_module

    def never_returns(*_: object) -> None:
        threading.Event().wait()

    def forward_hook(module: torch.nn.Module, _args: object, output: object = None) -> None:
        if not module.training or next(module.children(), None) is not None:
            return
        if backward:
            if not (isinstance(output, torch.Tensor) and output.requires_grad):
                return
            output.register_hook(never_returns)
        handle.remove()
        if not backward:
            never_returns()

    if backward:
        handle = nn_module.register_module_forward_hook(forward_hook)
    else:
        handle = nn_module.register_module_forward_pre_hook(forward_hook)


def parse(spec: str) -> Fault:
    m = _SPEC.match(spec.strip())
    if m is None or m.group(3) not in ACTIONS:
        raise UserError(
            f"{ENV}={spec!r} is not a fault",
            fix=f"write rank<R>:step<S>:<{'|'.join(ACTIONS)}>, e.g. {ENV}=rank1:step5:kill, or unset it",
        )
    return Fault(rank=int(m.group(1)), step=int(m.group(2)), action=m.group(3))


def check(world_size: int, spec: str | None, *, schedule: Schedule | None = None) -> None:
    """Pre-flight: a fault that is malformed or can never fire is an error, not a silent no-op. With
    the run's step schedule (where the data's size is known before loading), also a step the run
    never reaches, or a kill_in_save at a step that saves nothing."""
    if not spec:
        return
    fault = parse(spec)
    if fault.rank >= world_size or fault.step < 1 or (fault.action == "kill_in_save" and fault.rank != 0):
        raise UserError(
            f"{ENV}={spec!r} can never fire in a run of {world_size} rank(s)",
            fix=f"name a rank below {world_size} (rank0 for kill_in_save: only rank 0 saves) and a step >= 1",
        )
    if schedule is None:
        return
    last = schedule.total - 1 if fault.action in HANGS else schedule.total  # a hang is in the next step
    if fault.step > last:
        raise UserError(
            f"{ENV}={spec!r} can never fire: the run takes {schedule.total} optimizer steps",
            fix=f"name a step <= {last}, or train longer",
        )
    saves = schedule.save_steps()
    if fault.action == "kill_in_save" and fault.step not in saves:
        shown = ", ".join(str(s) for s in sorted(saves)[:5])
        raise UserError(
            f"{ENV}={spec!r} can never fire: no checkpoint is saved at step {fault.step}",
            fix=f"name a step that saves (here {shown}...), or set checkpoint.every_steps",
        )


@dataclass(frozen=True)
class Schedule:
    """Where a run's optimizer steps and periodic saves fall."""

    steps_per_epoch: int
    epochs: int
    total: int  # optimizer steps the run takes (LoopSettings.total_steps)
    every_steps: int | None

    def save_steps(self) -> set[int]:
        total, spe = self.total, max(self.steps_per_epoch, 1)
        steps = {total}
        if self.every_steps:
            steps |= set(range(self.every_steps, total + 1, self.every_steps))
        # every epoch end may save: periodically, or because best.pt improved
        steps |= {e * spe for e in range(1, self.epochs + 1) if e * spe <= total}
        return steps


def for_process(spec: str | None, *, rank: int, attempt: int, job_pid: int | None = None) -> Fault | None:
    """The fault this process must inject, if any: its rank is named and this is the first attempt."""
    if not spec or attempt > 0:
        return None
    fault = dataclasses.replace(parse(spec), job_pid=job_pid)
    if fault.rank != rank:
        return None
    log.warning("%s is set: rank %d will %s at step %d (testing only)", ENV, rank, fault.action, fault.step)
    return fault
