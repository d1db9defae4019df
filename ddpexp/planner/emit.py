"""From plan to launch (`ddpexp plan ... --emit torchrun|slurm|skypilot`): the file that runs the chosen
plan on its cluster, with the ddpexp overrides for its strategy and mesh.

  torchrun   a bash script: the torchrun line every node runs (NODE_RANK and MASTER_ADDR from the
             environment), as docs/clusters.md starts ddpexp under torchrun
  slurm      an sbatch script: one task per node, `srun torchrun ...` (ddpexp's Slurm path for more
             than one node; the submitit launcher runs one node per job)
  skypilot   a SkyPilot task YAML: the cluster's accelerators and nodes, the repository as its workdir,
             torchrun over SkyPilot's node list

The ddpexp command inside is one pre-flight accepted under torchrun on that cluster: the planner
checks every candidate that way (estimate.preflight) before it ranks it.
"""

from __future__ import annotations

import math
import shlex
from pathlib import Path
from typing import Any

import yaml

from ..errors import UserError
from .profiles import Cluster

FILES = {"torchrun": "plan_torchrun.sh", "slurm": "plan.sbatch", "skypilot": "plan_sky.yaml"}
PORT = 29500


def write(kind: str, path: Path | None, cluster: Cluster, args: list[str], hours: float, plan: str) -> Path:
    out = path or Path(FILES[kind])
    text = {"torchrun": torchrun_script, "slurm": sbatch_script, "skypilot": skypilot_task}[kind](
        cluster, args, hours, plan, file=shlex.quote(str(out))
    )
    out.write_text(text)
    if kind != "skypilot":
        out.chmod(0o755)
    return out


def _torchrun(cluster: Cluster, args: list[str], *, nnodes: str, node_rank: str, addr: str) -> str:
    line = [
        "torchrun",
        f"--nnodes={nnodes}",
        f"--nproc_per_node={cluster.devices_per_node}",
        f"--node_rank={node_rank}",
        f"--master_addr={addr}",
        f"--master_port={PORT}",
        "-m",
        "ddpexp",
        *(shlex.quote(a) for a in args),
    ]
    return " \\\n    ".join([" ".join(line[:6]), " ".join(line[6:])])


def torchrun_script(cluster: Cluster, args: list[str], hours: float, plan: str, *, file: str) -> str:
    return f"""#!/usr/bin/env bash
# ddpexp plan: {plan} on {cluster.devices} x {cluster.device} ({cluster.nodes} node(s)).
# Run on every node, from the same directory on a shared filesystem:
#   NODE_RANK=0..{cluster.nodes - 1} MASTER_ADDR=<node 0's address> bash {file}
set -euo pipefail
: "${{NODE_RANK:?set NODE_RANK (0 on the first node)}}"
: "${{MASTER_ADDR:?set MASTER_ADDR (the address of node 0)}}"
{_torchrun(cluster, args, nnodes=str(cluster.nodes), node_rank="$NODE_RANK", addr="$MASTER_ADDR")}
"""


def _walltime(hours: float) -> str:
    """The predicted time and half again, whole minutes, at least 10 (Slurm's HH:MM:SS)."""
    minutes = max(10, math.ceil(hours * 60 * 1.5)) if math.isfinite(hours) else 24 * 60
    return f"{minutes // 60:02d}:{minutes % 60:02d}:00"


def sbatch_script(cluster: Cluster, args: list[str], hours: float, plan: str, *, file: str) -> str:
    run = _torchrun(cluster, args, nnodes="$SLURM_NNODES", node_rank="$SLURM_NODEID", addr="$MASTER_ADDR")
    quoted = shlex.quote(run)  # expanded on each node, where SLURM_NODEID is that node's
    return f"""#!/usr/bin/env bash
# ddpexp plan: {plan} on {cluster.devices} x {cluster.device} ({cluster.nodes} node(s)).
# Time: the predicted time and half again. Submit with: sbatch {file}
#SBATCH --job-name=ddpexp-plan
#SBATCH --nodes={cluster.nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={cluster.devices_per_node}
#SBATCH --time={_walltime(hours)}
set -euo pipefail
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR
srun bash -c {quoted}
"""


def skypilot_task(cluster: Cluster, args: list[str], hours: float, plan: str, *, file: str) -> str:
    if not cluster.accelerator:
        raise UserError(
            f"{cluster.name} names no SkyPilot accelerator",
            setting=f"{cluster.name}.yaml: accelerator",
            fix="set accelerator: to SkyPilot's name for the device (H100, A100-80GB, L40S...)",
        )
    run = _torchrun(
        cluster,
        args,
        nnodes="$SKYPILOT_NUM_NODES",
        node_rank="$SKYPILOT_NODE_RANK",
        addr='$(echo "$SKYPILOT_NODE_IPS" | head -n 1)',
    )
    task: dict[str, Any] = {
        "name": "ddpexp-plan",
        "resources": {"accelerators": f"{cluster.accelerator}:{cluster.devices_per_node}"},
        "num_nodes": cluster.nodes,
        "workdir": ".",
        "setup": "pip install -c constraints.txt -e .\n",
        "run": run + "\n",
    }
    head = f"# ddpexp plan: {plan} on {cluster.devices} x {cluster.device}.\n"
    launch = f"# Launch with: sky launch {file}\n"
    return head + launch + yaml.dump(task, Dumper=_Blocks, sort_keys=False, width=1000)


class _Blocks(yaml.SafeDumper):
    """YAML with multi-line strings as literal blocks (`run: |`), as SkyPilot's examples write them."""


def _string(dumper: yaml.SafeDumper, text: str) -> yaml.Node:
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None)


_Blocks.add_representer(str, _string)
