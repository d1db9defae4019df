"""The degrees of one device mesh and where each rank sits in it (pure arithmetic: no process group).

Mesh dimensions, outermost first, as torchtitan's ParallelDims orders them: pp, dp_replicate, dp_shard,
cp, tp. Ranks that differ only in tp, cp (and pp) work on the same samples (cp ranks on different parts
of each sequence); consecutive ranks share a tp group, so on a node the tensor-parallel traffic, the
heaviest, stays between neighbours, and the context-parallel ring next to it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...errors import UserError

NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class Degrees:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    cp: int = 1

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, name) for name in NAMES)

    @property
    def world(self) -> int:
        return math.prod(self.shape)

    @property
    def dp(self) -> int:
        """Data-parallel ranks: how many shards each global batch splits into."""
        return self.dp_replicate * self.dp_shard

    @property
    def shard(self) -> int:
        """Ranks each parameter is sharded over (FSDP's shard group): dp_shard, and the cp ranks, which
        hold the same parameters and average their gradients as data-parallel ranks do (torchtitan's
        dp_shard x cp)."""
        return self.dp_shard * self.cp

    @property
    def fsdp(self) -> int:
        """Ranks FSDP spans (1: no FSDP): the shard groups, times their replicas."""
        return self.dp_replicate * self.shard

    def coordinates(self, rank: int) -> dict[str, int]:
        """Where `rank` sits on each dimension (row-major over NAMES, as init_device_mesh lays ranks)."""
        out: dict[str, int] = {}
        for name, size in reversed(list(zip(NAMES, self.shape, strict=True))):
            rank, out[name] = divmod(rank, size)
        return out

    def data_shard(self, rank: int) -> int:
        at = self.coordinates(rank)
        return at["dp_replicate"] * self.dp_shard + at["dp_shard"]

    def describe(self) -> str:
        """'dp_shard 2 x tp 2': the dimensions larger than 1 (or 'one rank')."""
        used = [f"{n} {s}" for n, s in zip(NAMES, self.shape, strict=True) if s > 1]
        return " x ".join(used) or "one rank"


def resolve(given: dict[str, int], world: int) -> Degrees:
    """The degrees `given` (strategy.pp, dp_replicate, dp_shard, cp, tp; one of them may be -1, the rest of
    the world) for `world` ranks, or a UserError saying which setting to change."""
    for name, value in given.items():
        if value == 0 or value < -1:
            raise UserError(
                f"must be a positive degree, or -1 for the rest of the world, got {value}",
                setting=f"strategy.{name}",
                fix=f"set strategy.{name} to a value >= 1 (or -1)",
            )
    rest = [name for name, value in given.items() if value == -1]
    if len(rest) > 1:
        raise UserError(
            f"{' and '.join(f'strategy.{n}' for n in rest)} are both -1 (the rest of the world)",
            setting=f"strategy.{rest[1]}",
            fix=f"give strategy.{rest[1]} a number; only one degree may take the rest of the world",
        )
    fixed = math.prod(v for v in given.values() if v != -1)
    product = " x ".join(f"{n} {v}" for n, v in given.items() if v != -1 and v > 1) or "1"
    if rest:
        if world % fixed:
            raise UserError(
                f"{world} ranks do not divide by {product} = {fixed}",
                setting="dist.nprocs",
                fix=f"run a multiple of {fixed} ranks (dist.nprocs), or change the degrees",
            )
        given = {**given, rest[0]: world // fixed}
    elif fixed != world:
        raise UserError(
            f"the degrees make {product} = {fixed} ranks, but the run has {world}",
            setting="dist.nprocs",
            fix=f"set dist.nprocs={fixed} (or drop it: strategy=nd starts as many as its degrees make), "
            "or set one degree to -1 to take the rest of the world",
        )
    return Degrees(**given)
