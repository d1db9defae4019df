"""The candidates a plan searches: the meshes a model can use on a cluster (`meshes`), and for each the
settings practitioners tune on top (`Settings`): the micro-batch (with gradient accumulation for the
rest of the local batch), activation checkpointing, torch.compile, and for FSDP the dtype it gathers
parameters in, whether it reshards them after the forward and whether it offloads its states to the
host."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from .profiles import Cluster

AC_MODES = ("none", "selective_half", "selective", "full")


@dataclass(frozen=True)
class Settings:
    """What a candidate sets besides its mesh (None: the run's own, as the user's overrides give it)."""

    accumulate: int = 1  # micro-batches per optimizer step (the local batch / the micro-batch)
    ac: str = "none"  # trainer.activation_checkpointing
    compile: bool = False  # trainer.compile
    gather: str | None = None  # FSDP's parameter dtype: None its default (bf16 under bf16 training), fp32
    reshard: bool | None = None  # FSDP's reshard_after_forward; None: the strategy's default
    offload: bool = False  # FSDP's states in host memory (strategy.offload)

    def overrides(self) -> list[str]:
        out = [
            f"trainer.accumulate={self.accumulate}",
            f"trainer.activation_checkpointing={self.ac}",
            f"trainer.compile={str(self.compile).lower()}",
        ]
        if self.gather is not None:
            out.append(f"strategy.mixed_precision={self.gather}")
        if self.reshard is not None:
            out.append(f"strategy.reshard_after_forward={str(self.reshard).lower()}")
        if self.offload:
            out.append("strategy.offload=true")
        return out

    def describe(self, micro_batch: float) -> str:
        parts = [f"mb {micro_batch:g}" + (f" x{self.accumulate}" if self.accumulate > 1 else ""), self.ac]
        if self.compile:
            parts.append("compile")
        if self.gather == "fp32":
            parts.append("fp32 gather")
        if self.reshard is False:
            parts.append("no reshard")
        if self.offload:
            parts.append("offload")
        return ", ".join(parts)


@dataclass(frozen=True)
class Candidate:
    """One way to spread the job: its mesh's label, its strategy section, and its settings."""

    label: str
    section: dict[str, Any]
    settings: Settings = field(default_factory=Settings)
    given: bool = False  # the layout the user gave, planned as given

    @property
    def mesh_overrides(self) -> list[str]:
        name = self.section["name"]
        return [
            f"strategy={name}",
            *(f"strategy.{k}={_text(v)}" for k, v in self.section.items() if k != "name"),
        ]

    @property
    def overrides(self) -> list[str]:
        """What selects it in a run: the strategy and its mesh, then the settings."""
        mine = {o.split("=", 1)[0] for o in self.settings.overrides()}
        return [
            *(o for o in self.mesh_overrides if o.split("=", 1)[0] not in mine),
            *self.settings.overrides(),
        ]

    @property
    def sharded(self) -> bool:
        """Whether FSDP shards its parameters (its gather dtype and resharding are settings)."""
        s = self.section
        return s["name"] == "fsdp" or (
            s["name"] == "nd" and (s.get("dp_shard", -1) != 1 or s.get("dp_replicate", 1) > 1)
        )

    def with_settings(self, settings: Settings) -> Candidate:
        return replace(self, settings=settings)


def _text(value: Any) -> str:
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else str(value)


# Sequences from this length on are also planned with context parallelism: below it a layer's
# activations are small beside its parameters, and the ring's exchanges buy nothing.
LONG_SEQUENCE = 16384


def meshes(
    cluster: Cluster, stages: int, *, loss_parallel: bool = False, seq_len: int = 0, experts: int = 0
) -> list[Candidate]:
    """The data-parallel strategies over every device, then nd's meshes: tensor parallelism within a
    node (2, 4, 8 ranks, with sequence parallelism, and loss parallelism where the model's plan has
    it, as torchtitan trains), pipeline stages (2, 4, 8; up to the model's `stages`; 1F1B, and the
    interleaved 1F1B with two stages a rank where the model has twice as many), FSDP over the rest;
    HSDP (a replica per node) over several nodes; pipeline's 1F1B with DDP replicas; and for
    sequences of LONG_SEQUENCE tokens or more, context parallelism within a node (2, 4, 8 ranks, each
    holding that share of every sequence; torchtitan's long-context layout) with FSDP over the rest.
    Sizes that do not divide the world (or, for cp, 2 x cp chunks of the sequence) are left out.

    A mixture of experts (`experts` per layer) is not planned with tensor parallelism (it runs, but
    its meshes would double the search, each slower to predict) and refuses context parallelism: its
    meshes are FSDP's and pipeline's, and each with expert parallelism over 2, 4, 8... ranks (experts
    and the data-parallel ranks divisible by it): within a node the all-to-alls stay on its links,
    across nodes they cross the network (the plan prices both)."""
    world, per_node = cluster.devices, cluster.devices_per_node
    split: dict[str, Any] = {"sequence_parallel": True} | ({"loss_parallel": True} if loss_parallel else {})
    named = " sp lp" if loss_parallel else " sp"
    out = [
        Candidate("ddp", {"name": "ddp"}),
        Candidate("zero", {"name": "zero"}),
        Candidate("fsdp", {"name": "fsdp"}),
    ]
    tps = [tp for tp in (2, 4, 8) if tp <= per_node and per_node % tp == 0] if not experts else []
    pps = [pp for pp in (2, 4, 8) if pp <= stages and world % pp == 0]
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
            if pp > 1 and stages >= 2 * pp:  # two stages a rank in a loop: a smaller bubble
                looped = {**mesh, "schedule": "interleaved_1f1b"}
                out.append(Candidate(f"nd {label} interleaved", {"name": "nd", "dp_shard": -1, **looped}))
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
    if experts:
        out += _expert_parallel(world, cluster.nodes, pps, experts)
    if seq_len >= LONG_SEQUENCE and not experts:
        for cp in (2, 4, 8):
            if cp <= per_node and per_node % cp == 0 and world % cp == 0 and seq_len % (2 * cp) == 0:
                section = {"name": "nd", "dp_shard": -1, "cp": cp}
                out.append(Candidate(f"nd fsdp{world // cp} x cp{cp}", section))
    for pp in pps:
        section = {"name": "pipeline", "stages": pp, "replicas": world // pp, "microbatches": 2 * pp}
        out.append(Candidate(f"pipeline {pp} stages x {world // pp} (1f1b)", {**section, "schedule": "1f1b"}))
    return out


def _expert_parallel(world: int, nodes: int, pps: list[int], experts: int) -> list[Candidate]:
    """EP over each power of two dividing the experts and a stage's data-parallel ranks, alone and
    with pipeline stages; with several nodes, also under HSDP (a replica per node, EP inside it)."""
    out = []
    for pp in [1, *pps]:
        shard = world // pp
        for ep in (2**k for k in range(1, 16)):
            if ep > shard or experts % ep or shard % ep:
                continue
            mesh: dict[str, Any] = {"name": "nd", "dp_shard": -1, "ep": ep}
            label = f"fsdp{shard} ep{ep}"
            if pp > 1:
                mesh |= {"pp": pp, "microbatches": 2 * pp, "schedule": "1f1b"}
                label = f"pp{pp} x {label}"
            out.append(Candidate(f"nd {label}", mesh))
            if pp == 1 and nodes > 1 and (world // nodes) % ep == 0:
                section = {"name": "nd", "dp_replicate": nodes, "dp_shard": -1, "ep": ep}
                out.append(Candidate(f"nd hsdp{nodes} x fsdp{world // nodes} ep{ep}", section))
    return out


def accumulations(local_batch: int, chunks: int = 1) -> list[int]:
    """The gradient accumulations a local batch of `local_batch` samples (per data shard) allows, each
    micro-batch whole (and splitting into `chunks` pipeline micro-batches): powers of two, the
    largest micro-batch (the whole batch, no accumulation) first."""
    return [
        a
        for a in (2**k for k in range(0, 20))
        if a <= local_batch and local_batch % a == 0 and (local_batch // a) % chunks == 0
    ]
