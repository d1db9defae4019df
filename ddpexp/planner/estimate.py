"""One candidate on a cluster (`estimate`): whether pre-flight would accept it there (`preflight`),
whether it fits (the memory model, ddpexp.predict.memory), its step time (each rank's ops on the
device, ddpexp.predict.device, plus the communication its `Strategy.communication` declares on the
cluster's links that compute does not hide: timing.py) and what a run to a target costs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..config import ActivationCheckpointing, Precision
from ..errors import UserError
from .profiles import GIB, Cluster
from .space import Candidate
from .timing import StepTime, compute, exposed_s, host_optimizer_s, optimizer_s

# A language model planned without data= is planned on synthetic tokens at its context, up to this: a
# Llama 3's context is 131,072 tokens, but it pretrained at 8,192 for most of its run.
DEFAULT_SEQ_CAP = 8192


@dataclass(frozen=True)
class Estimate:
    candidate: Candidate
    note: str | None = None  # why it cannot run; then nothing else is set
    peak_bytes: float = math.nan  # the largest rank's at the step's peak
    largest: str = ""  # its largest category
    fits: bool = False
    compute_s: float = math.nan
    exposed_s: float = math.nan  # communication the step waits for
    optimizer_s: float = math.nan
    step_s: float = math.nan
    tokens_per_s: float = math.nan
    mfu: float = math.nan
    bytes_intra: float = math.nan  # per rank and step, as comm/bytes_per_step counts them
    bytes_inter: float = math.nan
    steps: float = math.nan  # to the target
    time_s: float = math.nan
    cost: float = math.nan
    micro_batch: float = math.nan  # samples per micro-batch of a data shard
    devices: int = 0
    parts: dict[str, float] = field(default_factory=dict)  # the peak by category, bytes
    host_bytes: float = 0.0  # what the busiest node's host memory holds (offload)

    @property
    def tokens_per_s_per_device(self) -> float:
        return self.tokens_per_s / self.devices if self.devices else math.nan

    @property
    def label(self) -> str:
        c = self.candidate
        if not math.isfinite(self.micro_batch):
            return c.label
        return f"{c.label} ({c.settings.describe(self.micro_batch)})"


def chooses(overrides: list[str], group: str) -> bool:
    """Whether the command line chooses an option of `group` (data=..., +strategy=...)."""
    return any(o.split("=", 1)[0].lstrip("+~") == group for o in overrides)


def launch_args(overrides: list[str], plan_overrides: list[str], cluster: Cluster) -> list[str]:
    """The ddpexp command line of a plan: the user's overrides, the plan's strategy, mesh and settings
    (which win), on the cluster's devices."""
    from .. import strategies

    mine = {o.split("=", 1)[0] for o in plan_overrides}
    kept = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in mine]
    name = next((o.split("=", 1)[1] for o in plan_overrides if o.startswith("strategy=")), None)
    launch = cluster.launch
    if name is not None and not strategies.get(name).uses_process_group:
        launch = [o for o in launch if not o.startswith("backend=")]  # one process: no backend to name
    return [*kept, *plan_overrides, *launch]


EPOCH_STEPS = 100  # an emitted run's epoch of planned synthetic tokens: each epoch ends in an eval and a save


def target_args(job: Job, steps: float, *, planned_data: bool) -> list[str]:
    """What makes a launched run train what the plan priced: its steps (trainer.max_steps) and enough
    epochs of its data to hold them. The synthetic tokens a plan without data= assumed (two batches)
    become an epoch of up to EPOCH_STEPS steps, not thousands of two-step epochs."""
    if not math.isfinite(steps):
        return []  # no target: the run trains what the config says
    from ..data import build_source

    steps, batch = int(steps), job.global_batch
    extra = []
    if planned_data:
        per_epoch = min(steps, EPOCH_STEPS)
        extra = [f"data.train_tokens={per_epoch * batch * job.seq_len + 1}"]  # windows start every seq_len
    else:
        per_epoch = max(1, int(build_source(job.cfg.data).info().train_samples or 0) // batch)
    return [*extra, f"trainer.epochs={math.ceil(steps / per_epoch)}", f"trainer.max_steps={steps}"]


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
    input_dtype: Any = None
    experts: int = 0  # a mixture of experts' experts per layer (0: dense)

    @property
    def precision(self) -> str:
        return Precision.of(self.cfg.trainer.precision).name


def composed(overrides: list[str], seq_len: int | None) -> tuple[list[str], Any]:
    """The overrides and the config they compose. A model without data= is planned on synthetic tokens
    at its context length (`seq_len`, else the model's, at most DEFAULT_SEQ_CAP), enough of them for
    a step of the global batch."""
    from .. import composition

    with composition.composer() as compose:
        if chooses(overrides, "data"):
            cfg = compose(overrides)
            if seq_len is not None:
                raise UserError(
                    "--seq-len is for a model planned without data=",
                    setting="--seq-len",
                    fix="set the data's own length (e.g. data.block_size=N), or leave data= out",
                )
            return overrides, cfg
        lm = ["data=synthetic_tokens", "task=lm"]
        cfg = compose([*lm, *(o for o in overrides if o.split("=", 1)[0] not in ("data", "task"))])
        context = cfg.model.get("block_size")
        if seq_len is None and not isinstance(context, int):
            raise UserError(
                "the model names no context length to plan synthetic tokens at",
                setting="--seq-len",
                fix="give --seq-len N, or data=... with the tokens to train on",
            )
        length = seq_len if seq_len is not None else min(int(context), DEFAULT_SEQ_CAP)
        if length < 1:
            raise UserError(f"--seq-len {length}", setting="--seq-len", fix="give 1 or more tokens")
        tokens = 2 * int(cfg.trainer.batch_size) * (length + 1)  # a window holds length + 1 tokens
        data = [
            "data=synthetic_tokens",
            "task=lm",
            f"data.block_size={length}",
            f"data.train_tokens={max(tokens, 262144)}",
            f"data.eval_tokens={max(tokens // 8, 2 * (length + 1))}",
        ]
        mine = {o.split("=", 1)[0] for o in data}
        chosen = [*data, *(o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in mine)]
        return chosen, compose(chosen)


def job_of(overrides: list[str], cfg: Any, *, tokens: float | None, epochs: float | None) -> Job:
    """The job `cfg` describes, and its target: `tokens`, or `epochs` over the dataset's training split."""
    import torch

    from .. import models
    from ..data import build_source
    from ..models.moe import routing_layers
    from ..strategies.nd import tensor_parallel

    info = build_source(cfg.data).info()
    if info.targets != "token" or not info.tokens_per_sample:
        raise UserError(
            "the planner counts tokens: it needs a token corpus",
            setting="data",
            fix="leave data= out (a language model is planned on synthetic tokens at its context length), "
            "or give one: data=synthetic_tokens task=lm data.block_size=4096 (python_stdlib, text_files)",
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
    routed = routing_layers(model)
    experts = routed[0].cfg.experts if routed else 0
    flops = float(count(seq_len))
    return Job(overrides, cfg, model, batch, seq_len, flops, target, stages, lp, torch.long, experts)


def config_for(job: Job, candidate: Candidate) -> Any:
    """The job's config with the candidate's settings (accumulation, checkpointing, compile)."""
    import copy

    from omegaconf import open_dict

    cfg = copy.deepcopy(job.cfg)
    with open_dict(cfg):
        cfg.trainer.accumulate = candidate.settings.accumulate
        cfg.trainer.activation_checkpointing = candidate.settings.ac
        cfg.trainer.compile = candidate.settings.compile
    return cfg


def strategy_of(candidate: Candidate) -> Any:
    from .. import strategies

    section = dict(candidate.section)
    if candidate.settings.gather is not None:
        section["mixed_precision"] = candidate.settings.gather
    if candidate.settings.reshard is not None:
        section["reshard_after_forward"] = candidate.settings.reshard
    if candidate.settings.offload:
        section["offload"] = True
    return strategies.resolve(section)


def estimate(
    candidate: Candidate, job: Job, cluster: Cluster, fabric: Any, cache: dict[Any, Any] | None = None
) -> Estimate:
    """One candidate on `cluster`: memory, step time, throughput, MFU, bytes, time and cost to target.
    Pre-flight is the caller's (`preflight`, once per mesh)."""
    from ..optim import optimizer_states
    from ..predict.memory import predict
    from ..strategies.comm import Workload

    cfg = config_for(job, candidate)
    try:
        strategy = strategy_of(candidate)
        ranks = predict(
            cfg,
            world=cluster.devices,
            global_batch=job.global_batch,
            strategy=strategy,
            trace=cluster.achieved_mfu is None,
            extrapolate=True,
            nodes=cluster.nodes,
            cache=cache,
            model=job.model,
        )
    except UserError as exc:
        return Estimate(candidate, note=str(exc), devices=cluster.devices)
    worst = max(ranks, key=lambda r: r.peak)
    on_device = 0.0 if worst.offloaded else 1.0
    parts = {
        "parameters": worst.in_step,
        "gradients": worst.grads * on_device,
        "optimizer state": worst.optim_state * on_device,
        "activations": worst.activations,
        "the backward's temporaries": worst.transient,
        "copies": worst.copies,
        "FSDP's buffers": worst.buffers,
    }
    world = cluster.devices
    work = Workload(
        model=job.model,
        devices=world,
        world=world,
        nodes=cluster.nodes,
        global_batch=job.global_batch,
        accumulate=candidate.settings.accumulate,
        device_type=cluster.device_type,
        input_shape=(job.seq_len,),
        input_dtype=job.input_dtype,
        precision=job.precision,
        activation_checkpointing=candidate.settings.ac,
        fp8_all_gather=bool(job.cfg.trainer.get("fp8_all_gather", False)),
    )
    shards = len(set(strategy.data_layout(world_size=world)))
    timed = [(c, fabric.time_s(c)) for c in communication(strategy, work, cache)]
    if cluster.achieved_mfu is not None:
        times = _at_assumed_mfu(cfg, job, cluster, strategy, work, timed)
    else:
        times = _per_op(
            job, cluster, ranks, shards, timed, candidate.settings.compile, optimizer_states(cfg.optim)
        )
    per_node = cluster.devices_per_node
    host = max(sum(r.host for r in ranks[n : n + per_node]) for n in range(0, len(ranks), per_node))
    host_fits = not host or (cluster.host_memory_gib is not None and host <= cluster.host_memory_gib * GIB)
    tokens = job.global_batch * job.seq_len
    steps = math.ceil(job.target_tokens / tokens) if job.target_tokens else math.nan
    step = times.step_s
    time_s = steps * step
    peak = cluster.peak_flops(job.precision)
    return Estimate(
        candidate,
        peak_bytes=worst.peak,
        largest=max(parts, key=lambda k: parts[k]) if host_fits else "host memory",
        fits=worst.peak <= cluster.usable_bytes and host_fits,
        compute_s=times.compute_s,
        exposed_s=times.exposed_s,
        optimizer_s=times.optimizer_s,
        step_s=step,
        tokens_per_s=tokens / step,
        mfu=job.flops_per_token * tokens / step / (world * peak),
        bytes_intra=sum(c.counted for c, _ in timed if not c.inter_node and not c.host),
        bytes_inter=sum(c.counted for c, _ in timed if c.inter_node),
        steps=steps,
        time_s=time_s,
        cost=time_s / 3600 * world * cluster.price_per_device_hour,
        micro_batch=job.global_batch / shards / candidate.settings.accumulate,
        devices=world,
        parts=parts,
        host_bytes=host,
    )


def _per_op(
    job: Job,
    cluster: Cluster,
    ranks: list[Any],
    shards: int,
    timed: list[tuple[Any, float]],
    compiled: bool,
    states: int,
) -> StepTime:
    """The step from each rank's ops on the device (the slowest rank's), the communication compute
    does not hide, and the optimizer's step."""
    device = cluster.hardware
    slowest: tuple[float, float] = (0.0, 0.0)
    optimized = 0.0
    offloaded = any(r.offloaded for r in ranks)
    for r in ranks:
        if r.work is None or r.samples <= 0:
            continue
        passes = job.global_batch / shards / r.samples
        launched = _collective_launches(timed, passes * r.slots)
        forward, backward = compute(
            device.time(r.work, compiled=compiled, launches=launched), passes, r.slots
        )
        if forward + backward > sum(slowest):
            slowest = (forward, backward)
        optimized = max(optimized, r.optim_state / max(states, 1) if states else r.grads)
    forward, backward = slowest
    return StepTime(
        compute_s=forward + backward,
        exposed_s=exposed_s(timed, forward, backward),
        optimizer_s=host_optimizer_s(cluster, optimized, states)
        if offloaded
        else optimizer_s(device, optimized, states),
        forward_s=forward,
        backward_s=backward,
    )


# Kernels the host launches for each call of a collective: the communication kernel, and the copies into
# and out of its flat buffer (FSDP's copy-in and copy-out around each all-gather and reduce-scatter).
KERNELS_PER_CALL = 3


def _collective_launches(timed: list[tuple[Any, float]], passes: float) -> tuple[float, float]:
    """The kernels a rank's collectives add to the host's work per micro-batch slot, (forward,
    backward): those overlapping the forward to it, the rest to the backward."""
    from ..strategies.comm import Overlap

    forward = sum(c.calls for c, _ in timed if c.overlaps == Overlap.forward)
    rest = sum(c.calls for c, _ in timed if c.overlaps != Overlap.forward)
    return forward * KERNELS_PER_CALL / passes, rest * KERNELS_PER_CALL / passes


def communication(strategy: Any, work: Any, cache: dict[Any, Any] | None) -> list[Any]:
    """`strategy.communication(job=work)`, kept in `cache` by what decides it (its settings and the
    workload: a tensor-parallel plan's runs the model's forward on the meta device)."""
    if cache is None:
        return list(strategy.communication(job=work))
    shapes = tuple(tuple(p.shape) for p in work.model.parameters())
    sizes = (
        work.world,
        work.nodes,
        work.global_batch,
        work.accumulate,
        work.input_shape,
        work.precision,
        work.activation_checkpointing,
    )
    key = ("communication", strategy.name, repr(strategy.settings), sizes, hash(shapes))
    if key not in cache:
        cache[key] = list(strategy.communication(job=work))
    return list(cache[key])


def _at_assumed_mfu(
    cfg: Any, job: Job, cluster: Cluster, strategy: Any, work: Any, timed: list[tuple[Any, float]]
) -> StepTime:
    """The profile's achieved_mfu override: the model's FLOPs at that share of the peak, the strategy's
    share of them on the critical path, a third of them forward."""
    from ..predict.model import Host, hidden_s

    assert cluster.achieved_mfu is not None
    step_flops = job.flops_per_token * job.global_batch * job.seq_len
    if ActivationCheckpointing(str(cfg.trainer.activation_checkpointing)) == ActivationCheckpointing.full:
        step_flops *= 4 / 3  # the forward again, in the backward
    peak = cluster.peak_flops(job.precision)
    compute_s = step_flops * strategy.compute_share(job=work) / (peak * cluster.achieved_mfu)
    # A CPU profile's device is a one-thread process on a core of its own.
    host = Host(cluster.device_type, cores=cluster.devices_per_node, threads=1)
    overlap = host.overlap_efficiency(cluster.devices_per_node)
    exposed = sum(t for _, t in timed) - hidden_s(timed, compute_s, overlap)
    return StepTime(compute_s, exposed, 0.0, compute_s / 3, 2 * compute_s / 3)
