"""ps: a parameter server. Rank 0, the server, holds the model and the optimizer and computes nothing;
ranks 1..W-1, the workers, compute gradients on their share of every global batch, push them to the
server and pull the parameters back. W = dist.nprocs (3 on a CPU host: 1 server + 2 workers).

Why rank 0 serves: rank 0 is the rank that writes checkpoints, metrics.json and model.pt, so the
server's parameters and optimizer state are saved as they are, with nothing to gather. Before every
evaluation and save, `sync_buffers` broadcasts the server's parameters and buffers, so every rank
scores, and every file holds, the server's model. Checkpoints are the common full state (the model's
state_dict, the server's optimizer state): a ps run resumes under any strategy and any run under ps.

Data (`data_layout` = [0, 0, 1, ..., W-2]): worker r reads shard r-1 of W-1, so the global batch splits
over the workers, global/(W-1) samples each. The server reads shard 0 as well, only so that its loop
has as many batches as the workers'; it never computes on them (its `train_step` returns None) and its
evaluation module scores nothing (its eval shard repeats worker 1's).

Messages, torch.distributed point-to-point send/recv, one flat buffer of S elements each (the
parameters' dtype: float32 carries the integer BatchNorm batch counter exactly below 2^24):
  push  worker -> server: the trained parameters' gradients, then every buffer's change since the
        worker's last pull (BatchNorm running statistics move in the workers' forwards; the server,
        which runs none, adds the changes, so its statistics follow the training batches)
  pull  server -> worker: the trained parameters, then the buffers

mode=sync, one update per global batch (each worker global/(W-1) samples), equal to `single`:
  step k  worker: forward (the first one of the step first receives the pull owed for step k-1) ->
                  backward -> sync_grads: push, then .grad = None (its optimizer is a stand-in)
          server: train_step: send the pull owed for step k-1 to every worker -> sync_grads:
                  receive one push from every worker, average them in rank order, set .grad and add
                  the buffer changes -> the engine clips, steps the server's optimizer, steps the LR
                  schedule, exactly as for `single`
  The server cannot send step k's parameters when its step ends: the engine's own collectives
  (logging, evaluation, checkpoints, the epoch's reductions) follow optimizer.step, and a worker
  blocked waiting for parameters would never join them. So the pull is owed: it leaves at the start of
  the next step, or as the broadcast before an evaluation or save, which always precede the end of a
  run. Server and workers keep the same `owed` flag, as they run the same loop.
mode=async, every push is one update, applied as it arrives:
  worker  forward -> backward -> the engine clips its gradient -> optimizer.step() (the stand-in):
          push, wait for the reply, load it
  server  sync_grads, W-1 times: receive a push from whichever worker sends first (recv with
          src=None), set .grad, add the buffer changes, step the optimizer, reply to that worker with
          the parameters. The engine's optimizer step on the server then finds no gradient.
  So the server makes W-1 updates per engine step, each on global/(W-1) samples, at the LR the
  schedule gives that engine step (the LR is the configured one: at the same LR, async takes W-1 times
  as many, W-1 times smaller steps). Staleness (`ps/staleness_mean`, `ps/staleness_max` per epoch):
  the server's updates between a worker's pull and its push, counted on the server from the version
  it last sent each worker; with 2 workers taking turns every push after the first is 1 update stale.

Why it cannot deadlock. Every rank runs the same loop: the same steps, and the engine's collectives at
the same steps. Sync: within a step the workers wait only for the server and the server only for the
workers' pushes, which need nothing from it (the owed pull was received before the forward); between
steps nobody waits for a point-to-point message, so everyone reaches the collectives. Async: a worker
makes its (k+1)-th push only after its k-th reply, and never passes a collective after step m before
the server does; the server handles exactly m(W-1) pushes before that collective, which are precisely
the pushes of steps 1..m, each of which is made (every reply is sent at once). A fast worker may push
twice while a slow one pushes once: the server takes pushes in arrival order, so the count works out.

Why send/recv over the process group, not torch.distributed.rpc: it is what the rest of ddpexp uses
(one gloo group, the supervisor's failure handling, the timeouts of dist.timeout_s), it needs no second
runtime with its own rendezvous and thread pools, and in sync mode it is deterministic (pushes summed
in rank order): the parity with `single` is exact to float rounding. The server's loop is the
engine's loop, so nothing has to run in the background.

Bytes (`comm/bytes_per_step` under trainer.measure_comm) are what each rank sends, as the engine
averages them over the ranks: per step every worker pushes S bytes and the server sends W-1 pulls of
S, so 2(W-1)/W x S per rank (4/3 x S at W = 3). A sync pull is counted in the step of the push it
answers (it leaves at the next step's start or with the evaluation broadcast). Times are the host time
inside the sends and receives, waits for the peer included: the server mostly waits.

On CUDA the flat buffers travel through host memory over gloo (NCCL has no receive-from-anyone):
backend='cpu:gloo,cuda:nccl'.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from .. import distributed
from ..config import StrategyConfig
from ..errors import UserError
from ..optim import OptimizerSpec
from . import FP16_OWN_STEP, ReportColumn, Strategy, Wrapped, register
from .comm import Collective, CommMeter, Held, Workload

if TYPE_CHECKING:
    from ..context import RunContext
    from ..plan import HostFacts, Plan

# `async` is a Python keyword: the functional form gives the member the name a user types (OmegaConf
# matches a string to an Enum member by name).
PsMode = StrEnum("PsMode", [("sync", "sync"), ("async", "async")])
SYNC, ASYNC = PsMode["sync"], PsMode["async"]


@dataclass
class PsConfig(StrategyConfig):
    # sync: the server averages one push from every worker and steps once per global batch (= single);
    # async: the server steps on every push as it arrives and replies at once (parameters may be stale).
    mode: PsMode = SYNC


@register
class Ps(Strategy[PsConfig]):
    name = "ps"
    schema = PsConfig
    report_columns = (
        ReportColumn("staleness: mean/max", ("ps/staleness_mean", "ps/staleness_max"), ("{:.2f}", "{:.0f}")),
    )

    def default_nprocs(self, *, device_type: str, host: HostFacts, devices_per_process: int) -> int:
        if device_type == "cuda":
            return super().default_nprocs(
                device_type=device_type, host=host, devices_per_process=devices_per_process
            )
        return 3  # one server and two workers

    def data_layout(self, *, world_size: int) -> list[int]:
        return [0, *range(world_size - 1)]  # the server reads worker 1's shard, and ignores it

    def check(self, *, plan: Plan, host: HostFacts) -> None:
        if plan.world_size < 2:
            raise UserError(
                f"a parameter server needs a server and at least one worker, got {plan.world_size} process",
                setting="dist.nprocs",
                fix="use dist.nprocs=3 (rank 0 serves, ranks 1 and 2 train), or 2 for one worker",
            )
        if plan.backend == "nccl":
            raise UserError(
                "ps receives pushes from whichever worker sends first, which NCCL cannot do",
                setting="backend",
                fix="use backend='cpu:gloo,cuda:nccl' (ps's messages then go through host memory over gloo)",
            )

    def wrap(self, model: nn.Module, *, ctx: RunContext, measure_comm: bool) -> Wrapped:
        model = model.to(ctx.device)
        flat = Flat(model)
        meter = CommMeter() if measure_comm else None
        mode = PsMode(self.settings.mode)
        role = Server if dist.get_rank() == 0 else Worker
        node: Server | Worker = role(flat, mode=mode, meter=meter)
        node.sync_buffers()  # every worker starts from the server's parameters and buffers
        metrics = node.staleness_metrics if mode == ASYNC else None
        if isinstance(node, Server):
            return PsWrapped(
                module=model,
                base=model,
                sync_grads=node.sync_grads,
                eval_module=ScoresNothing(),
                comm=meter,
                sync_buffers=node.sync_buffers,
                train_step=node.train_step,
                extra_metrics=metrics,
                node=node,
            )
        return PsWrapped(
            module=PullsFirst(model, node.pull_if_owed) if mode == SYNC else model,
            base=model,
            sync_grads=node.sync_grads,
            comm=meter,
            sync_buffers=node.sync_buffers,
            extra_metrics=metrics,
            node=node,
        )

    def build_optimizer(self, wrapped: Wrapped, make: OptimizerSpec) -> torch.optim.Optimizer:
        """The server's is the configured optimizer; a worker's a stand-in that holds nothing."""
        node = _node(wrapped)
        if isinstance(node, Server):
            node.optimizer = make(wrapped.base.parameters())
            return node.optimizer
        return RemoteOptimizer(node.flat.params, lr=float(make.kwargs.get("lr", 0.0)), step=node.step)

    def communication(self, *, job: Workload) -> list[Collective]:
        """Every worker's push and pull of the flat buffer (S bytes: the trained parameters and the
        buffers in the parameters' dtype) per step, all through the server's link, so one after the
        other: 2(W-1) messages of S per step, whatever W is (the server's link does not grow with W).
        Workers on the server's node reach it over the intra-node link, the others over the network.
        Counted as the meter counts them: 2(W-1)/W x S per rank. Async mode puts the same messages
        through the same link per step; that a worker's compute may overlap other workers' messages
        is not credited (modelled as sync)."""
        world = job.world
        if world < 2:
            raise UserError(
                "a parameter server needs at least 2 processes", setting="devices", fix="predict 2 or more"
            )
        params = [p for p in job.model.parameters() if p.requires_grad]
        numel = sum(p.numel() for p in params) + sum(b.numel() for b in job.model.buffers())
        size = float(numel * (params[0].element_size() if params else 4))
        local = min(job.procs_per_node, world) - 1  # the workers on the server's node
        out = []
        for workers, inter in ((local, False), (world - 1 - local, True)):
            if workers:
                where = "other nodes, over the network" if inter else "the server's node"
                out.append(
                    Collective(
                        f"pushes and pulls of {workers} worker(s) on {where}, through the server's link",
                        "sendrecv",
                        2 * workers * size,
                        2,
                        calls=2 * workers,
                        counted=2 * workers * size / world,
                        inter_node=inter,
                    )
                )
        return out

    def fp16_conflict(self, *, world_size: int) -> str | None:
        return FP16_OWN_STEP  # the server's step

    def compute_share(self, *, job: Workload) -> float:
        return 1.0 / max(job.world - 1, 1)  # the server computes nothing; W-1 workers split the batch

    def held(self, *, job: Workload) -> list[Held]:
        """The server the model with its gradients and optimizer state, computing nothing; each worker
        the parameters only (it hands its gradients to the server and drops them; its optimizer is a
        stand-in with no state) and global/(W-1) samples."""
        workers = max(job.world - 1, 1)
        server = replace(Held.replica(job.model, 0.0), chain=(), loss=False)
        worker = Held.replica(job.model, job.global_batch / workers / job.accumulate, grads=0, optimized=0)
        return [server, *[worker] * (job.world - 1)]

    def load_model_state(self, wrapped: Wrapped, state: dict[str, torch.Tensor]) -> None:
        wrapped.base.load_state_dict(state)
        _node(wrapped).loaded()  # every rank loaded the same state: nothing is owed, nothing stale

    def load_optimizer_state(
        self, wrapped: Wrapped, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        if isinstance(_node(wrapped), Server):  # a worker's stand-in holds nothing: the state is the server's
            optimizer.load_state_dict(state)


class Flat:
    """The model's trained parameters and its buffers laid end to end, in host memory: a pull is their
    values, a push the parameters' gradients and the buffers' changes since the last pull."""

    def __init__(self, model: nn.Module) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.buffers = list(model.buffers())
        self.dtype = self.params[0].dtype if self.params else torch.float32
        self.sizes = [t.numel() for t in [*self.params, *self.buffers]]
        self.numel = sum(self.sizes)
        self.nbytes = self.numel * torch.empty((), dtype=self.dtype).element_size()
        self.param_numel = sum(p.numel() for p in self.params)
        self.pulled = self._cat(self.buffers)  # the buffers as last pulled: a push sends the change

    def empty(self) -> torch.Tensor:
        return torch.empty(self.numel, dtype=self.dtype)

    def values(self) -> torch.Tensor:
        """A pull: the parameters, then the buffers."""
        return self._cat([p.detach() for p in self.params] + self.buffers)

    def changes(self) -> torch.Tensor:
        """A push: the gradients (zero for a parameter that got none), then each buffer's change since
        the last pull."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = self._cat(grads + self.buffers)
        flat[self.param_numel :] -= self.pulled
        return flat

    @torch.no_grad()
    def load(self, flat: torch.Tensor) -> None:
        """Take a pull: this rank's parameters and buffers become the server's."""
        for tensor, part in zip([*self.params, *self.buffers], flat.split(self.sizes), strict=True):
            tensor.copy_(part.view_as(tensor))
        self.pulled = flat[self.param_numel :].clone()

    @torch.no_grad()
    def apply(self, flat: torch.Tensor) -> None:
        """Take a push on the server: its gradients become .grad, its buffer changes are added."""
        parts = flat.split(self.sizes)
        for p, part in zip(self.params, parts, strict=False):
            p.grad = part.view_as(p).to(p.device, p.dtype)
        for buf, part in zip(self.buffers, parts[len(self.params) :], strict=True):
            change = part.view_as(buf) if buf.is_floating_point() else part.view_as(buf).round()
            buf.add_(change.to(buf.device, buf.dtype))

    def mark_pulled(self) -> None:
        """The buffers as they are now count as pulled (every rank holds the same state)."""
        self.pulled = self._cat(self.buffers)

    def _cat(self, tensors: Iterable[torch.Tensor]) -> torch.Tensor:
        parts = [t.reshape(-1).to("cpu", self.dtype) for t in tensors]
        return torch.cat(parts) if parts else torch.empty(0, dtype=self.dtype)


class Server:
    """Rank 0: receives pushes, steps the optimizer, sends pulls (see the module docstring)."""

    def __init__(self, flat: Flat, *, mode: PsMode, meter: CommMeter | None) -> None:
        self.flat, self.mode, self.meter = flat, mode, meter
        self.workers = list(range(1, dist.get_world_size()))
        self.optimizer: torch.optim.Optimizer | None = None  # build_optimizer's (async steps it per push)
        self.owed = False  # sync: the last update's parameters have not left for the workers yet
        self.version = 0  # async: updates applied since every worker last held the server's parameters
        self.pulled = dict.fromkeys(self.workers, 0)  # async: the version each worker last pulled
        self.staleness: list[int] = []  # async: of every push this epoch

    def train_step(self, inputs: Any, targets: torch.Tensor, scale: float, loss: Any) -> None:
        """The server's micro-batch: no computation; at a step's start, the parameters owed to the workers."""
        if self.owed:
            start = time.perf_counter()
            pull = self.flat.values()
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, pull, w) for w in self.workers]):
                distributed.wait_for(work)
            self.owed = False
            _record(self.meter, start, 0)  # counted with the pushes they answer

    def sync_grads(self) -> None:
        if self.mode == SYNC:
            self._average()
        else:
            self._serve()

    def _average(self) -> None:
        """Sync: one push from every worker, summed in rank order (deterministic), divided by W-1."""
        start = time.perf_counter()
        inboxes = [self.flat.empty() for _ in self.workers]
        receives = [dist.P2POp(dist.irecv, box, w) for box, w in zip(inboxes, self.workers, strict=True)]
        for work in dist.batch_isend_irecv(receives):
            distributed.wait_for(work)
        total = inboxes[0]
        for box in inboxes[1:]:
            total += box
        self.flat.apply(total.div_(len(self.workers)))
        self.owed = True
        _record(self.meter, start, len(self.workers) * self.flat.nbytes, "parameters")  # the pulls

    def _serve(self) -> None:
        """Async: W-1 pushes, each applied as it arrives and answered at once."""
        assert self.optimizer is not None, "build_optimizer gives the server its optimizer"
        for _ in self.workers:
            start = time.perf_counter()
            inbox = self.flat.empty()
            src = dist.recv(inbox)  # from whichever worker pushes first
            _record(self.meter, start, 0)
            self.staleness.append(self.version - self.pulled[src])
            self.flat.apply(inbox)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.version += 1
            start = time.perf_counter()
            dist.send(self.flat.values(), src)
            self.pulled[src] = self.version
            _record(self.meter, start, self.flat.nbytes, "parameters")

    def sync_buffers(self) -> None:
        """Before evaluation and saves: every rank gets the server's parameters and buffers."""
        dist.broadcast(self.flat.values(), src=0)
        self.loaded()

    def loaded(self) -> None:
        self.owed = False
        self.pulled = dict.fromkeys(self.workers, self.version)

    def staleness_metrics(self) -> dict[str, float]:
        return _staleness(self.staleness)


class Worker:
    """Ranks 1..W-1: compute gradients, push them, pull the parameters (see the module docstring)."""

    def __init__(self, flat: Flat, *, mode: PsMode, meter: CommMeter | None) -> None:
        self.flat, self.mode, self.meter = flat, mode, meter
        self.owed = False  # sync: the server owes this worker the last update's parameters

    def pull_if_owed(self) -> None:
        """Sync, before a forward: receive the parameters of the update this worker's last push made."""
        if self.owed:
            start = time.perf_counter()
            self._receive()
            self.owed = False
            _record(self.meter, start, 0)

    def sync_grads(self) -> None:
        """Sync: push the gradient before the engine would clip it (the server clips the average)."""
        if self.mode != SYNC:
            return
        start = time.perf_counter()
        dist.send(self.flat.changes(), 0)
        for p in self.flat.params:
            p.grad = None  # the stand-in optimizer has nothing to step
        self.owed = True
        _record(self.meter, start, self.flat.nbytes)

    def step(self) -> None:
        """The stand-in optimizer's step. Async: push the (clipped) gradient, load the reply."""
        if self.mode != ASYNC:
            return
        start = time.perf_counter()
        dist.send(self.flat.changes(), 0)
        self._receive()
        _record(self.meter, start, self.flat.nbytes)

    def _receive(self) -> None:
        inbox = self.flat.empty()
        dist.recv(inbox, 0)
        self.flat.load(inbox)

    def sync_buffers(self) -> None:
        inbox = self.flat.empty()
        dist.broadcast(inbox, src=0)
        self.flat.load(inbox)
        self.owed = False

    def loaded(self) -> None:
        self.flat.mark_pulled()
        self.owed = False

    def staleness_metrics(self) -> dict[str, float]:
        return _staleness([])  # the server counts; every rank joins the reduction


@dataclass
class PsWrapped(Wrapped):
    node: Server | Worker | None = None  # this rank's role, for build_optimizer and checkpoints


def _node(wrapped: Wrapped) -> Server | Worker:
    if not isinstance(wrapped, PsWrapped) or wrapped.node is None:
        raise TypeError(f"ps needs the model its own wrap returned, got {type(wrapped).__name__}")
    return wrapped.node


class RemoteOptimizer(torch.optim.Optimizer):
    """A worker's optimizer: the real one is the server's. It holds no state; step() is the worker's
    part of an update (async: push the clipped gradient, load the reply; sync: nothing, the push left
    in sync_grads). Its learning rate follows the schedule but is never used."""

    def __init__(self, params: list[nn.Parameter], *, lr: float, step: Callable[[], None]) -> None:
        super().__init__(params, {"lr": lr})
        self._step = step

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        self._step()
        return None


class PullsFirst(nn.Module):
    """A sync worker's training module: the model, run after receiving any parameters the server owes."""

    def __init__(self, model: nn.Module, pull: Callable[[], None]) -> None:
        super().__init__()
        self.model = model
        self._pull = pull

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._pull()
        return self.model(*args, **kwargs)


class ScoresNothing(nn.Module):
    """The server's evaluation module: its eval shard repeats worker 1's, so it scores nothing."""

    def forward(self, *args: Any, **kwargs: Any) -> None:
        return None


def _staleness(seen: list[int]) -> dict[str, float]:
    """The epoch's staleness over every rank's pushes (only the server counts them)."""
    sums = distributed.all_reduce_sum(torch.tensor([float(sum(seen)), float(len(seen))], dtype=torch.float64))
    top = distributed.all_reduce_max(float(max(seen, default=0)))
    total, count = sums.tolist()
    seen.clear()
    return {"ps/staleness_mean": total / max(count, 1.0), "ps/staleness_max": top}


def _record(meter: CommMeter | None, start: float, nbytes: int, kind: str = "gradients") -> None:
    if meter is not None:
        meter.record(start, time.perf_counter(), nbytes, kind)
