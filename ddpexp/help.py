"""`ddpexp --help`: the config groups and their options, one line each, read from conf/ itself
(the first sentence of each YAML file's header comment), so the help can never fall out of date."""

from __future__ import annotations

import re
from pathlib import Path

# Listed first, in this order; any other group folder in conf/ (except hydra) follows alphabetically.
PREFERRED = ("strategy", "model", "data", "optim")
# conf/ folders of profiles, not training config groups: ddpexp-predict's interconnects, ddpexp plan's
# clusters and their devices.
PROFILE_FOLDERS = ("interconnect", "cluster", "devices")
NOT_GROUPS = ("hydra", "__pycache__", *PROFILE_FOLDERS)

USAGE = """\
ddpexp: compare distributed training strategies on one model, from Hydra configs.

Usage:
  python -m ddpexp [group=option ...] [key=value ...]      one run
  python -m ddpexp -m strategy=single,ddp [key=value ...]   a sweep (one job per combination)
  torchrun --nproc_per_node=2 -m ddpexp strategy=ddp        as workers of an external launcher
  python -m ddpexp.commbench [key=value ...]                the collective benchmark (its own --help)
  python -m ddpexp plan --cluster 8xh100_sxm [key=value ...] strategies ranked for a cluster (--help)
  python -m ddpexp.predict.memory [key=value ...]           memory per rank, predicted

Config groups (pick one option each, e.g. strategy=ddp):
{groups}

Frequent settings (full list: python -m ddpexp --cfg job):
  trainer.epochs=10  trainer.batch_size=64 (GLOBAL batch, split over ranks)  trainer.max_steps=...
  strategy.KEY=VALUE: a strategy's own settings (python -m ddpexp --cfg job strategy=NAME lists them;
    a key the chosen strategy lacks is refused, naming the strategies that have it)
  backend=auto|nccl|gloo|mpi  init=env|tcp|file  device=auto|cpu|cuda  seed=0
  dist.nprocs=N (processes per node)  dist.master_port=P (default: a free port)  dist.timeout_s=600
  dist.max_restarts=N (restart after a failure, resuming from the newest checkpoint)
  dist.nnodes=N dist.node_rank=R dist.master_addr=NODE0 dist.master_port=P (one command per machine)
  hydra/launcher=slurm (with -m: one Slurm job per sweep job)
  loader.mode=auto|device|dataloader
  trainer.precision=32|bf16|fp16|fp8 (fp8: the blocks' linear layers in float8; trainer.fp8_recipe=rowwise;
    trainer.fp8_all_gather=true: FSDP gathers their weights in float8)
  trainer.accumulate=K  trainer.clip_grad_norm=X  trainer.compile=true
  optim.schedule=constant|step|cosine  optim.warmup_steps=N  optim.scale_rule=none|linear|sqrt
  checkpoint.every_epochs=1  checkpoint.every_steps=N  trainer.resume=auto|PATH  trainer.mode=train|eval
  model.weights=PATH (initial weights; model.weights_strict=false: only what fits, e.g. a new head)
  model._target_=my_models.Net  data._target_=my_models.dataset (your own, from this directory)

Outputs: each run directory holds config.yaml, plan.json, metrics.json, model.pt, TensorBoard events, logs/.
  tensorboard --logdir outputs/  (or a multirun/ sweep directory)

Hydra's own flags: --cfg job|hydra|all, --info, --hydra-help, -m/--multirun, --config-dir DIR."""


# A sentence ends at . ! or ? followed by a capital (so "e.g. the" does not end one) or by the end.
SENTENCE = re.compile(r".*?[.!?](?=\s+[A-Z]|$)")


def first_comment(path: Path) -> str:
    """The first sentence of the file's header comment, which may run over several comment lines."""
    header = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        if not line.startswith("# @package"):
            header.append(line.lstrip("# ").strip())
    text = " ".join(header)
    sentence = SENTENCE.match(text)
    return sentence.group() if sentence else text


def help_text(conf_dir: str | None = None) -> str:
    from .composition import conf_dir as shipped

    root = Path(conf_dir or shipped())
    lines = []
    folders = [d.name for d in root.iterdir() if d.is_dir() and d.name not in NOT_GROUPS]
    groups = [g for g in PREFERRED if g in folders] + sorted(set(folders) - set(PREFERRED))
    for group in groups:
        options = sorted((root / group).glob("*.yaml"))
        lines.append(f"  {group}:")
        width = max((len(p.stem) for p in options), default=0)
        for p in options:
            lines.append(f"    {p.stem.ljust(width)}  {first_comment(p)}")
    return USAGE.format(groups="\n".join(lines))
