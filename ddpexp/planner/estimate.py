"""Every strategy and mesh a model can use on a cluster (`candidates`), and for each (`estimate`):
whether pre-flight would accept it there (`preflight`), whether it fits (the memory model,
ddpexp.predict.memory), its step time (compute from the model's FLOPs at the device's peak x the
achieved share, plus the communication its `Strategy.communication` declares on the cluster's links,
less what hides behind compute) and what a run to a target costs."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..config import ActivationCheckpointing, Precision
from ..errors import UserError
from .profiles import Cluster


@dataclass(frozen=True)
class Candidate:
    """One way to spread the job: its label, its strategy section and the overrides that select it."""

    label: str
    section: dict[str, Any]

    @property
    def overrides(self) -> list[str]:
        name = self.section["name"]
        return [
            f"strategy={name}",
            *(f"strategy.{k}={_text(v)}" for k, v in self.section.items() if k != "name"),
        ]


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def candidates(cluster: Cluster, stages: int, *, loss_parallel: bool = False) -> list[Candidate]:
    """The data-parallel strategies over every device, then nd's meshes: tensor parallelism within a
    node (2, 4, 8 ranks, with sequence parallelism, and loss parallelism where the model's plan has
    it, as torchtitan trains), pipeline stages (2, 4; up to the model's `stages`), FSDP over the rest;
    HSDP (a replica per node) over several nodes; and pipeline's 1F1B with DDP replicas. Sizes that
    do not divide the world are left out."""
    world, per_node = cluster.devices, cluster.devices_per_node
    split: dict[str, Any] = {"sequence_parallel": True} | ({"loss_parallel": True} if loss_parallel else {})
    named = " sp lp" if loss_parallel else " sp"
    out = [
        Candidate("ddp", {"name": "ddp"}),
        Candidate("zero", {"name": "zero"}),
        Candidate("fsdp", {"name": "fsdp"}),
        Candidate("fsdp_no_reshard", {"name": "fsdp", "reshard_after_forward": False}),
    ]
    tps = [tp for tp in (2, 4, 8) if tp <= per_node and per_node % tp == 0]
    pps = [pp for pp in (2, 4) if pp <= stages and world % pp == 0]
    for pp in [1, *pps]:
        for tp in [1, *tps]:
            if (pp, tp) == (1, 1) or world % (pp * tp):
                continue
            mesh: dict[str, Any] = {"tp": tp, **split} if tp > 1 else {}
            if pp > 1:
                mesh |= {"pp": pp, "microbatches": 2 * pp, "schedule": "1f1b"}
            label = " x ".join(
                [
                    *([f"pp{pp}"] if pp > 1 else []),
                    f"fsdp{world // (pp * tp)}",
                    *([f"tp{tp}{named}"] if tp > 1 else []),
                ]
            )
            out.append(Candidate(f"nd {label}", {"name": "nd", "dp_shard": -1, **mesh}))
    if cluster.nodes > 1:
        for tp in [1, *tps]:
            shard = world // cluster.nodes // tp
            mesh = {"tp": tp, **split} if tp > 1 else {}
            label = f"hsdp{cluster.nodes} x fsdp{shard}" + (f" x tp{tp}{named}" if tp > 1 else "")
            out.append(
                Candidate(
                    f"nd {label}", {"name": "nd", "dp_replicate": cluster.nodes, "dp_shard": -1, **mesh}
                )
            )
    for pp in pps:
        section = {"name": "pipeline", "stages": pp, "replicas": world // pp, "microbatches": 2 * pp}
        out.append(Candidate(f"pipeline {pp} stages x {world // pp} (1f1b)", {**section, "schedule": "1f1b"}))
    return out


@dataclass(frozen=True)
class Estimate:
    candidate: Candidate
    note: str | None = None  # why it cannot run; then nothing else is set
    peak_bytes: float = math.nan  # the largest rank's at the step's peak
    largest: str = ""  # its largest category
    fits: bool = False
    compute_s: float = math.nan
    exposed_s: float = math.nan  # communication the step waits for
    step_s: float = math.nan
    tokens_per_s: float = math.nan
    mfu: float = math.nan
    bytes_intra: float = math.nan  # per rank and step, as comm/bytes_per_step counts them
    bytes_inter: float = math.nan
    steps: float = math.nan  # to the target
    time_s: float = math.nan
    cost: float = math.nan


def launch_args(overrides: list[str], plan_overrides: list[str], cluster: Cluster) -> list[str]:
    """The ddpexp command line of a plan: the user's overrides, the plan's strategy and mesh (which win),
    on the cluster's devices."""
    mine = {o.split("=", 1)[0] for o in plan_overrides}
    kept = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in mine]
    return [*kept, *plan_overrides, *cluster.launch]


def preflight(args: list[str], cluster: Cluster) -> None:
    """Pre-flight's checks of the command line `args` as torchrun would start it on `cluster` (its
    devices per node, its world size): what a run there would refuse, in one line."""
    from .. import composition
    from ..plan import ExternalWorld, HostFacts
    from ..preflight import check_job

    gpus = cluster.devices_per_node if cluster.device_type == "cuda" else 0
    host = HostFacts(cuda_devices=gpus, nccl=gpus > 0, gloo=True, mpi=False)
    world = ExternalWorld(world_size=cluster.devices, local_world_size=cluster.devices_per_node)
    with composition.composer() as compose:
        cfg = compose(args)
    check_job(cfg, host, external=world)


@dataclass(frozen=True)
class Job:
    """What every candidate shares: the composed config (and the overrides it came from), its model,
    the global batch, tokens per sample, the model's FLOPs per token and the target in tokens."""

    overrides: list[str]
    cfg: Any
    model: Any  # on the meta device: shapes for the strategies' communication
    global_batch: int
    seq_len: int
    flops_per_token: float
    target_tokens: float
    stages: int  # the model's stages() (pipeline's limit)
    loss_parallel: bool  # whether its tensor-parallel plan can keep the logits split


def job_of(overrides: list[str], cfg: Any, *, tokens: float | None, epochs: float | None) -> Job:
    """The job `cfg` describes, and its target: `tokens`, or `epochs` over the dataset's training split."""
    import torch

    from .. import models
    from ..data import build_source
    from ..strategies.nd import tensor_parallel

    info = build_source(cfg.data).info()
    if info.targets != "token" or not info.tokens_per_sample:
        raise UserError(
            "the planner counts tokens: it needs a token corpus",
            setting="data",
            fix="e.g. data=synthetic_tokens task=lm data.block_size=4096 (or python_stdlib, text_files)",
        )
    with torch.device("meta"):
        model = models.build(cfg.model, info)
    count = getattr(model, "flops_per_token", None)
    if not callable(count):
        raise UserError(
            f"{type(model).__name__} does not count its FLOPs (flops_per_token)",
            setting="model",
            fix="plan a GPT-style model (model=gpt_small, gpt2_124m, llama3_2_1b, llama3_1_8b...)",
        )
    seq_len = int(info.tokens_per_sample)
    batch = int(cfg.trainer.batch_size)
    if epochs is not None:
        if not info.train_samples:
            raise UserError("the dataset does not say its size", setting="--epochs", fix="give --tokens N")
        target = epochs * info.train_samples * seq_len
    else:
        target = float(tokens or 0)
    split = getattr(model, "stages", None)
    stages = len(split()) if callable(split) else 1
    lp = tensor_parallel.splits_loss(model)
    return Job(overrides, cfg, model, batch, seq_len, float(count(seq_len)), target, stages, lp)


def estimate(candidate: Candidate, job: Job, cluster: Cluster, fabric: Any) -> Estimate:
    """One candidate on `cluster`: memory, step time, throughput, MFU, bytes, time and cost to target."""
    from .. import strategies
    from ..predict.memory import predict
    from ..predict.model import Host, hidden_s
    from ..strategies.comm import Workload

    try:
        preflight(launch_args(job.overrides, candidate.overrides, cluster), cluster)
        strategy = strategies.resolve(candidate.section)
        world = cluster.devices
        ranks = predict(job.cfg, world=world, global_batch=job.global_batch, strategy=strategy)
    except UserError as exc:
        return Estimate(candidate, note=str(exc))
    worst = max(ranks, key=lambda r: r.peak)
    parts = {
        "parameters": worst.in_step,
        "gradients": worst.grads,
        "optimizer state": worst.optim_state,
        "activations": worst.activations,
        "the backward's temporaries": worst.transient,
        "copies": worst.copies,
    }
    import torch

    work = Workload(
        model=job.model,
        devices=world,
        world=world,
        nodes=cluster.nodes,
        global_batch=job.global_batch,
        accumulate=int(job.cfg.trainer.accumulate),
        device_type=cluster.device_type,
        input_shape=(job.seq_len,),
        input_dtype=torch.long,
    )
    precision = Precision.of(job.cfg.trainer.precision)
    peak = cluster.peak_flops(precision.name)
    step_flops = job.flops_per_token * job.global_batch * job.seq_len
    if ActivationCheckpointing(job.cfg.trainer.activation_checkpointing) == ActivationCheckpointing.full:
        step_flops *= 4 / 3  # the forward again, in the backward
    compute = step_flops * strategy.compute_share(job=work) / (peak * cluster.achieved_mfu)
    timed = [(c, fabric.time_s(c)) for c in strategy.communication(job=work)]
    # A CPU profile's device is a one-thread process on a core of its own.
    host = Host(cluster.device_type, cores=cluster.devices_per_node, threads=1)
    overlap = host.overlap_efficiency(cluster.devices_per_node)
    exposed = sum(t for _, t in timed) - hidden_s(timed, compute, overlap)
    step = compute + exposed
    tokens = job.global_batch * job.seq_len
    steps = math.ceil(job.target_tokens / tokens) if job.target_tokens else math.nan
    time_s = steps * step
    return Estimate(
        candidate,
        peak_bytes=worst.peak,
        largest=max(parts, key=lambda k: parts[k]),
        fits=worst.peak <= cluster.usable_bytes,
        compute_s=compute,
        exposed_s=exposed,
        step_s=step,
        tokens_per_s=tokens / step,
        mfu=job.flops_per_token * tokens / step / (world * peak),
        bytes_intra=sum(c.counted for c, _ in timed if not c.inter_node),
        bytes_inter=sum(c.counted for c, _ in timed if c.inter_node),
        steps=steps,
        time_s=time_s,
        cost=time_s / 3600 * world * cluster.price_per_device_hour,
    )
