"""Pre-flight's checks of this machine and its network: the worker processes fit its cores and memory,
the rendezvous (address, port, file) can be reached or made, and a dataset to download can be."""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

from .. import host
from ..errors import UserError
from ..plan import Plan

if TYPE_CHECKING:  # the data package imports torch
    from ..data.source import Download

log = logging.getLogger(__name__)

# What a worker forked from the forkserver (torch already imported) holds of its own once its process
# group and loop run, before its model and data: the floor of the memory check's estimate. Measured on
# the development VM (2026-11-28): 100-103 MiB unique to each of 4 ddp workers training model=toy.
WORKER_BASELINE_BYTES = 100 << 20
# A download host that takes no connection in this long is as good as unreachable for the run.
DOWNLOAD_CONNECT_TIMEOUT_S = 5.0


def check_cpu_processes(cfg: DictConfig, p: Plan) -> None:
    cores = os.cpu_count() or 1
    if p.device_type == "cpu" and p.nprocs_per_node > 4 * cores and not cfg.dist.oversubscribe:
        raise UserError(
            f"{p.nprocs_per_node} worker processes on a host with {cores} cores",
            setting="dist.nprocs",
            fix=f"use dist.nprocs<={4 * cores} (or dist.oversubscribe=true if you mean it)",
        )


def check_host_memory(cfg: DictConfig, p: Plan, model: Any, info: Any) -> None:
    """What this machine's ranks hold must fit in its available memory, checked for every run, in
    process too: each rank's model states as the memory model counts them (parameters, gradients and
    optimizer state, sharded as its strategy shards them: `Strategy.held`) and, for each worker
    process started here, a worker's own baseline. A floor: data and activations come on top, so a
    refusal is certain, not a guess. On GPUs the states live in device memory: only the workers'
    processes and their parameters (a CPU copy each builds first) are counted here.
    dist.memory_check=false skips it."""
    # Only ranks ddpexp starts here (torchrun's, and a plan's for a cluster, are another machine's).
    if not cfg.dist.get("memory_check", True) or p.launcher not in ("inprocess", "spawn"):
        return
    from .. import optim, strategies
    from ..strategies.comm import Held, Workload

    try:
        strategy = strategies.resolve(cfg.strategy)
        nodes = max(p.world_size // max(p.nprocs_per_node, 1), 1)
        job = Workload.of(cfg, info, model, world=p.world_size, global_batch=p.global_batch, nodes=nodes)
        mine = strategy.held(job=job)[: p.nprocs_per_node]  # this node's ranks (the first node's layout)
    except Exception as exc:  # a cost model that cannot say must not stop a run: the parameters, whole
        log.debug("memory check on whole parameters: %s", exc)
        mine = [Held.replica(model, 0.0)] * p.nprocs_per_node
    states = optim.optimizer_states(cfg.optim)
    if p.device_type == "cpu":
        held = [float(h.params + h.grads + h.optimized * states) for h in mine]
        what = "parameters, gradients and optimizer state"
    else:
        held = [float(h.params) for h in mine]
        what = "parameters"
    workers = p.nprocs_per_node if p.launcher == "spawn" else 0
    need = sum(held) + workers * WORKER_BASELINE_BYTES
    available = host.available_memory()
    if need <= available:
        return
    mib = 1 << 20
    each = max(held) + (WORKER_BASELINE_BYTES if workers else 0)
    fits = int(available // each) if each else 0
    ranks = f"{len(held)} ranks on this machine need" if len(held) > 1 else "the run needs"
    process = f" plus {WORKER_BASELINE_BYTES // mib} MiB for each worker process" if workers else ""
    fixes = [
        f"dist.nprocs<={fits}" if 0 < fits < len(held) else None,
        "a strategy that shards (strategy=fsdp)",
    ]
    raise UserError(
        f"{ranks} at least {need / mib:,.0f} MiB ({max(held) / mib:,.0f} MiB a rank of {what}, "
        f"as the memory model counts them{process}; activations come on top), and "
        f"{available // mib:,} MiB is available",
        setting="dist.memory_check",
        fix=f"use {' or '.join(f for f in fixes if f)}, a smaller model or batch, free memory, or "
        "dist.memory_check=false to start anyway",
    )


def check_master_addr(cfg: DictConfig) -> None:
    import socket

    addr = cfg.dist.master_addr
    if cfg.init.value not in ("env", "tcp") and cfg.dist.nnodes == 1:  # several nodes meet node 0 there
        return
    try:
        socket.getaddrinfo(addr, None)
    except OSError as exc:
        raise UserError(
            f"{addr!r} does not resolve ({exc.strerror or exc})",
            setting="dist.master_addr",
            fix="use an address or host name every node can reach (127.0.0.1 on one machine)",
        ) from exc


def check_port(cfg: DictConfig) -> None:
    from ..launch.rendezvous import port_is_free

    port = cfg.dist.master_port
    if port is None:
        return
    ports = [port] if cfg.init.value in ("env", "tcp") else []
    if cfg.dist.nnodes > 1:
        ports.append(port + 1)  # node 0's launcher hands the job to the other nodes there
    busy = next((p for p in ports if not port_is_free(cfg.dist.master_addr, p)), None)
    if busy is not None:
        raise UserError(
            f"port {busy} on {cfg.dist.master_addr} is already in use",
            setting="dist.master_port",
            fix="pick another port, one whose next port is free too, on every node's command"
            if cfg.dist.nnodes > 1
            else "pick another port, or leave dist.master_port unset to get a free one",
        )


def check_init_file(cfg: DictConfig) -> None:
    path = cfg.dist.init_file
    if cfg.init.value != "file" or path is None:
        return
    if Path(path).exists():
        raise UserError(
            f"rendezvous file {path} already exists (a stale file would join the wrong run)",
            setting="dist.init_file",
            fix="delete it if no run uses it, or leave dist.init_file unset for a fresh one in the run dir",
        )
    parent = Path(path).resolve().parent
    if not parent.is_dir():
        raise UserError(
            f"the directory of {path} does not exist",
            setting="dist.init_file",
            fix="create it on a filesystem every rank can see, or leave dist.init_file unset",
        )
    try:  # os.access says yes to root even where the filesystem refuses (/sys): ask the filesystem
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".ddpexp-probe-"):
            pass
    except OSError as exc:
        raise UserError(
            f"cannot create {path}: {exc.strerror or exc} in {parent}",
            setting="dist.init_file",
            fix="put it in a directory you can write to, on a filesystem every rank can see, "
            "or leave dist.init_file unset",
        ) from exc


def check_download(download: Download, *, timeout_s: float = DOWNLOAD_CONNECT_TIMEOUT_S) -> None:
    """A dataset that will be downloaded: one of its hosts (or the proxy urllib would use for it, from
    http_proxy/https_proxy as the download itself reads them) takes a TCP connection. Without one, the
    run would fail only after its processes started and torchvision tried every mirror."""
    reasons = []
    for url in download.urls:
        reason = _unreachable(url, timeout_s)
        if reason is None:
            return
        reasons.append(reason)
    raise download.error(download.urls[0], reasons[0])


def _unreachable(url: str, timeout_s: float) -> str | None:
    """Why a connection to `url`'s host (or its proxy) cannot be opened, or None when it can."""
    import socket
    import urllib.parse
    import urllib.request

    parts = urllib.parse.urlsplit(url)
    address = (parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80))
    proxy = urllib.request.getproxies().get(parts.scheme)
    via = ""
    if proxy and not urllib.request.proxy_bypass(address[0]):
        proxied = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        address = (proxied.hostname or "", proxied.port or 80)
        via = f" through the proxy {address[0]}:{address[1]}"
    try:
        socket.create_connection(address, timeout=timeout_s).close()
    except TimeoutError:
        return f"no connection{via} within {timeout_s:g} s"
    except OSError as exc:
        return f"unreachable{via} ({exc.strerror or exc})"
    return None
