"""Turn a composed config into a launch plan, or refuse it: pure, no processes, no files written.

`plan()` is a pure function of the config and the host's facts, so every refusal is unit-testable
without GPUs. Everything a worker needs to know about the run's shape (world size, backend, per-rank
batch) is decided here once, in the parent, and shipped to the workers with the config.
"""

from __future__ import annotations

import contextlib
import math
import re
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from . import strategies
from .config import ActivationCheckpointing, Device, Fp8Recipe, InitMethod, Mode, Precision
from .errors import UserError, require_positive
from .plan import ExternalWorld, HostFacts, Plan

if TYPE_CHECKING:
    from .strategies import Strategy

BACKENDS = ("nccl", "gloo", "mpi")
_COMBINED_BACKEND = re.compile(r"^(cpu|cuda):(nccl|gloo|mpi)(,(cpu|cuda):(nccl|gloo|mpi))*$")


def plan(cfg: DictConfig, host: HostFacts, external: ExternalWorld | None = None) -> Plan:
    """The launch layout of one job, or a UserError. The strategy decides its devices per process and
    default process count, and checks the finished plan against its own settings."""
    _check_finite(cfg)
    strategy = strategies.resolve(cfg.strategy)
    _check_sizes(cfg)
    device_type = _device_type(cfg.device, host)
    k = strategy.devices_per_process(device_type=device_type, host=host)
    launcher, nprocs, world = _layout(cfg, strategy, device_type, host, external, k)
    if device_type == "cuda" and nprocs * k > host.cuda_devices:
        raise UserError(
            f"{nprocs} processes x {k} device(s) need {nprocs * k} GPUs; {host.cuda_devices} are visible",
            setting="dist.nprocs",
            fix=f"use dist.nprocs<={max(host.cuda_devices // k, 1)} or device=cpu",
        )
    backend: str | None = _backend(str(cfg.backend), device_type, host)  # checked even unused
    if not strategy.uses_process_group:
        backend = None
    acc = cfg.trainer.accumulate
    layout = tuple(strategy.data_layout(world_size=world))
    shards = len(set(layout))
    per_rank = cfg.trainer.batch_per_rank
    global_batch = per_rank * shards * acc if per_rank is not None else cfg.trainer.batch_size
    if global_batch % (shards * acc):
        readers = "ranks" if shards == world else "data shards"
        parts = f"{shards} {readers}" + (f" x {acc} accumulated micro-batches" if acc > 1 else "")
        raise UserError(
            f"global batch {global_batch} does not split evenly over {parts}",
            setting="trainer.batch_size",
            fix=f"use a multiple of {shards * acc}, "
            f"e.g. trainer.batch_size={_round_up(global_batch, shards * acc)}",
        )
    _check_training(cfg, device_type)
    if cfg.trainer.checkpoint_on_signal and launcher == "torchrun":
        raise UserError(
            "torchrun stops its workers itself on a signal, so ddpexp cannot make them save first",
            setting="trainer.checkpoint_on_signal",
            fix="launch with python -m ddpexp (dist.nprocs=N) instead of torchrun, or set it to false",
        )
    eval_global = cfg.trainer.eval_batch_size or global_batch
    result = Plan(
        strategy=strategy.name,
        launcher=launcher,
        device_type=device_type,
        backend=backend,
        init=InitMethod(cfg.init).value,
        world_size=world,
        nprocs_per_node=nprocs,
        devices_per_process=k,
        global_batch=global_batch,
        per_rank_batch=global_batch // (shards * acc),
        eval_per_rank_batch=max(1, eval_global // shards),
        replicas=shards if strategy.uses_process_group else k,
        data_parallel=shards,
        shard_of_rank=layout,
        pinned_devices=strategy.pinned_devices() if device_type == "cuda" else (),
        precision=Precision.of(cfg.trainer.precision).name,
        activation_checkpointing=ActivationCheckpointing(cfg.trainer.activation_checkpointing).value,
    )
    strategy.check(plan=result, host=host)
    why = strategy.fp16_conflict(world_size=world) if cfg.trainer.precision == Precision.fp16 else None
    if why is not None:
        raise UserError(why, setting="trainer.precision", fix=strategies.FP16_FIX)
    return result


def _layout(
    cfg: DictConfig,
    strategy: Strategy[Any],
    device_type: str,
    host: HostFacts,
    external: ExternalWorld | None,
    k: int,
) -> tuple[str, int, int]:
    """(launcher, processes per node, world size)."""
    init = InitMethod(cfg.init).value
    _check_nodes(cfg.dist, strategy, external)
    if not strategy.uses_process_group:
        if external is not None and external.world_size > 1:
            raise UserError(
                f"strategy {strategy.name!r} is single-process but the launcher started "
                f"{external.world_size} processes",
                setting="strategy",
                fix="use strategy=ddp under torchrun, or run without torchrun",
            )
        # A restart needs a supervisor outside the failing process: then even one process is spawned;
        # so is a CPU run from a process whose OpenMP threads spin (it would not be timed as the CLI's).
        spawned = cfg.dist.max_restarts or (host.spinning_threads and device_type == "cpu")
        return ("spawn" if spawned else "inprocess"), 1, 1
    if external is not None:
        if init != "env":
            raise UserError(
                f"init={init} is for self-launched runs; under torchrun the launcher's rendezvous "
                "connects the ranks",
                setting="init",
                fix="drop the init override when running under torchrun",
            )
        if cfg.dist.max_restarts:
            raise UserError(
                "is for self-launched runs; torchrun restarts its workers itself",
                setting="dist.max_restarts",
                fix="pass --max-restarts to torchrun instead (ddpexp resumes from the newest checkpoint)",
            )
        return "torchrun", external.local_world_size, external.world_size
    nprocs = cfg.dist.nprocs
    if nprocs is None:
        nprocs = strategy.default_nprocs(device_type=device_type, host=host, devices_per_process=k)
    return "spawn", nprocs, nprocs * cfg.dist.nnodes


def _check_nodes(dist: DictConfig, strategy: Strategy[Any], external: ExternalWorld | None) -> None:
    """dist.nnodes/dist.node_rank: several machines, each self-launching its share of the ranks; they
    meet node 0 on a port known in advance (launch/nodes.py)."""
    nnodes, node_rank = dist.nnodes, dist.node_rank
    if not 0 <= node_rank < nnodes:
        raise UserError(
            f"is {node_rank}, outside 0..{nnodes - 1} for dist.nnodes={nnodes}",
            setting="dist.node_rank",
            fix=f"give each machine its own dist.node_rank from 0 to {nnodes - 1} (0 at dist.master_addr)",
        )
    if nnodes == 1:
        return
    if external is not None:
        raise UserError(
            "is for self-launched runs; under torchrun its --nnodes counts the machines",
            setting="dist.nnodes",
            fix="drop dist.nnodes and dist.node_rank when running under torchrun",
        )
    if not strategy.uses_process_group:
        raise UserError(
            f"strategy {strategy.name!r} runs one process, on one machine",
            setting="dist.nnodes",
            fix="use strategy=ddp (or another multi-process strategy) across machines, or dist.nnodes=1",
        )
    if dist.master_port is None:
        raise UserError(
            f"must be set with dist.nnodes={nnodes}: every node meets node 0 on it",
            setting="dist.master_port",
            fix="add dist.master_port=29500 (or any port free on node 0) to every node's command",
        )
    if dist.master_port >= 65535:
        raise UserError(
            "leaves no port for node 0's launcher, which listens on dist.master_port + 1",
            setting="dist.master_port",
            fix="use a port below 65535",
        )
    if dist.max_restarts:
        raise UserError(
            "would restart one node's workers, not the others'",
            setting="dist.max_restarts",
            fix="start every node again with trainer.resume=auto, or run under torchrun --max-restarts",
        )


def _check_sizes(cfg: DictConfig) -> None:
    t = cfg.trainer
    positive = {
        "trainer.epochs": t.epochs,
        "trainer.batch_size": t.batch_size,
        "trainer.accumulate": t.accumulate,
        "trainer.eval_every_epochs": t.eval_every_epochs,
        "trainer.log_every_steps": t.log_every_steps,
        "trainer.time_comm_every_steps": t.time_comm_every_steps,
        "dist.timeout_s": cfg.dist.timeout_s,
        "dist.nnodes": cfg.dist.nnodes,
    }
    optional_positive = {
        "trainer.eval_batch_size": t.eval_batch_size,
        "dist.nprocs": cfg.dist.nprocs,
        "dist.hang_timeout_s": cfg.dist.hang_timeout_s,
        "trainer.threads": t.threads,
    }
    positive["trainer.repeats"] = t.repeats
    require_positive(positive, optional_positive)
    if t.max_steps is not None and t.max_steps < 0:
        raise UserError(
            f"must be >= 0, got {t.max_steps}",
            setting="trainer.max_steps",
            fix="set trainer.max_steps=0 (evaluate the initial weights only) or more, or null",
        )
    if cfg.loader.num_workers < 0:
        raise UserError("must be >= 0", setting="loader.num_workers", fix="set loader.num_workers=0 or more")
    if cfg.dist.max_restarts < 0:
        raise UserError("must be >= 0", setting="dist.max_restarts", fix="set dist.max_restarts=0 or more")
    port = cfg.dist.master_port
    if port is not None and not 0 < port < 65536:
        raise UserError(f"{port} is not a TCP port", setting="dist.master_port", fix="use 1..65535 or null")
    _check_address(cfg.dist.master_addr)


_HOST_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


def _check_address(addr: str) -> None:
    """dist.master_addr must be an IP address or a host name; the port goes in dist.master_port."""
    import ipaddress

    with contextlib.suppress(ValueError):
        ipaddress.ip_address(addr)
        return
    labels = addr.rstrip(".").split(".")
    numeric = all(label.isdigit() for label in labels)
    if numeric or len(addr) > 253 or not all(_HOST_LABEL.match(label) for label in labels):
        host, sep, port = addr.rpartition(":")
        hint = (
            f"dist.master_addr={host} dist.master_port={port}"
            if sep and port.isdigit()
            else "an IP address (10.0.0.1) or a host name (node001)"
        )
        raise UserError(
            f"{addr!r} is not an IP address or host name", setting="dist.master_addr", fix=f"use {hint}"
        )


def _device_type(device: Device, host: HostFacts) -> str:
    if device == Device.auto:
        return "cuda" if host.cuda_devices else "cpu"
    if device == Device.cuda and not host.cuda_devices:
        raise UserError("no CUDA device is visible", setting="device", fix="use device=cpu (or auto)")
    return Device(device).value


def _backend(requested: str, device_type: str, host: HostFacts) -> str:
    requested = requested.lower()  # torch accepts GLOO as well as gloo
    if requested == "auto":
        return "nccl" if device_type == "cuda" and host.nccl else "gloo"
    if requested in BACKENDS:
        names = [requested]
    elif _COMBINED_BACKEND.match(requested):
        names = [part.split(":")[1] for part in requested.split(",")]
    else:
        raise UserError(
            f"unknown backend {requested!r}",
            setting="backend",
            fix="use auto, nccl, gloo, mpi or a per-device form such as cpu:gloo,cuda:nccl",
        )
    if "nccl" in names and requested == "nccl" and device_type != "cuda":
        raise UserError(
            "nccl needs CUDA devices and this run is on the CPU",
            setting="backend",
            fix="use backend=gloo (or auto) on CPU",
        )
    if "nccl" in names and requested != "nccl" and device_type != "cuda":
        raise UserError(
            f"{requested} makes an NCCL group, which needs CUDA devices; this run is on the CPU",
            setting="backend",
            fix="use backend=gloo (or auto) on CPU",
        )
    if "nccl" in names and not host.nccl:
        raise UserError("this PyTorch build has no NCCL", setting="backend", fix="use backend=gloo")
    if "mpi" in names and not host.mpi:
        raise UserError(
            "this PyTorch build has no MPI support",
            setting="backend",
            fix="use backend=gloo (or nccl on GPUs), or build PyTorch from source with MPI",
        )
    if "gloo" in names and not host.gloo:
        raise UserError("this PyTorch build has no gloo", setting="backend", fix="use backend=nccl or mpi")
    return requested


def _check_finite(cfg: DictConfig) -> None:
    """No setting may be nan or infinite (a YAML .nan or .inf, or 1e400 on the command line): every
    float of the composed config, whatever its section, refused before anything reads it (a nan
    threshold compares false with everything, so clip_grad_norm=nan trained unclipped and
    hang_timeout_s=nan switched hang detection off)."""
    plain = {
        str(key): OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
        for key, value in cfg.items()
        if key != "hydra"  # Hydra's own, with interpolations only a running job resolves
    }

    def walk(value: Any, path: str) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(inner, f"{path}.{key}" if path else str(key))
        elif isinstance(value, list):
            for index, inner in enumerate(value):
                walk(inner, f"{path}[{index}]")
        elif isinstance(value, float) and not math.isfinite(value):
            raise UserError(
                f"must be a finite number, got {value}", setting=path, fix=f"give {path} a finite value"
            )

    walk(plain, "")


def _check_training(cfg: DictConfig, device_type: str) -> None:
    t, o = cfg.trainer, cfg.optim
    if t.precision == Precision.fp16 and device_type != "cuda":
        raise UserError(
            "fp16 mixed precision needs CUDA (its loss scaling is a GPU feature)",
            setting="trainer.precision",
            fix="use trainer.precision=bf16 on CPU, or 32",
        )
    if t.get("fp8_all_gather") and t.precision != Precision.fp8:
        raise UserError(
            f"gathers the float8 layers' weights in float8, and this run has none: it trains in "
            f"{t.precision.name}",
            setting="trainer.fp8_all_gather",
            fix="add trainer.precision=fp8, or drop trainer.fp8_all_gather",
        )
    if t.get("fp8_all_gather") and t.fp8_recipe != Fp8Recipe.tensorwise:
        raise UserError(
            f"needs one scale per weight (tensorwise); {t.fp8_recipe.value} scales each row, and "
            "torchao gathers such weights in bf16",
            setting="trainer.fp8_all_gather",
            fix="use trainer.fp8_recipe=tensorwise, or drop trainer.fp8_all_gather",
        )
    if t.mode == Mode.eval and not t.resume and not cfg.model.get("weights"):
        raise UserError(
            "an evaluation run needs weights to evaluate",
            setting="trainer.mode",
            fix="add trainer.resume=PATH/TO/checkpoint.pt (or model.pt, or any state_dict file), "
            "or model.weights=PATH",
        )
    positive = {
        "trainer.accumulate": t.accumulate,
        "optim.ref_batch_size": o.ref_batch_size,
        "optim.step_size": o.step_size,
        "checkpoint.keep_last_k": cfg.checkpoint.keep_last_k,
    }
    optional = {
        "trainer.batch_per_rank": t.batch_per_rank,
        "trainer.eval_every_steps": t.eval_every_steps,
        "trainer.clip_grad_norm": t.clip_grad_norm,
        "checkpoint.every_epochs": cfg.checkpoint.every_epochs,
        "checkpoint.every_steps": cfg.checkpoint.every_steps,
    }
    require_positive(positive, optional)
    if o.warmup_steps < 0:
        raise UserError("must be >= 0", setting="optim.warmup_steps", fix="use optim.warmup_steps=0 or more")


def _round_up(n: int, m: int) -> int:
    return ((n + m - 1) // m) * m


def check_split_sizes(train_samples: int, eval_samples: int, p: Plan, cfg: DictConfig) -> None:
    """A run that would take no optimizer step, or score nothing, is refused rather than reported as
    completed with its initial weights."""
    t = cfg.trainer
    trains = t.mode == Mode.train and t.epochs > 0 and t.max_steps != 0
    if trains and p.steps_per_epoch(train_samples, t.accumulate) == 0:
        raise UserError(
            f"{train_samples} training samples give no optimizer step at global batch {p.global_batch}"
            + (f" x {t.accumulate} accumulated" if t.accumulate > 1 else ""),
            setting="trainer.batch_size",
            fix=f"use trainer.batch_size<={max(train_samples // t.accumulate, 1)} or more training data",
        )
    if eval_samples < 1:
        raise UserError(
            "the eval split is empty: nothing to evaluate",
            setting="data",
            fix="give the dataset an eval split (data.val_fraction for a single Dataset, data.num_eval...)",
        )
