"""Every config-group option composes under the schema and instantiates; bad settings fail at
composition or pre-flight with one line, exit code 2, and nothing started or created."""

from __future__ import annotations

import itertools
import os
import re
from pathlib import Path

import pytest
import torch
from hydra import compose

from ddpexp import models, optim, tasks
from ddpexp.composition import conf_dir
from ddpexp.data import DataSource
from ddpexp.help import PROFILE_FOLDERS, help_text
from ddpexp.plan import HostFacts
from ddpexp.validate import plan

from .fake_data import WRITERS
from .test_gpt_model import PUBLISHED

GROUPS = sorted(  # profiles (ddpexp-predict's interconnects, ddpexp plan's clusters) are no config group
    p.name
    for p in Path(conf_dir()).iterdir()
    if p.is_dir() and not p.name.startswith("_") and p.name not in PROFILE_FOLDERS
)
OPTIONS = [(g, f.stem) for g in GROUPS for f in sorted((Path(conf_dir()) / g).glob("*.yaml"))]
TEXT_MODELS = {"gcnn", "embbag"}
TOKEN_DATA = {"python_stdlib", "synthetic_tokens", "text_files"}  # task=lm's
# The published shapes are built on the meta device, as pre-flight and ddpexp-predict build them.
GPT_MODELS = {"gpt", "gpt_tiny", "gpt_small", "gpt_moe_tiny", "gpt_moe_small"}
EXPERT_PARALLEL = {"nd_ep", "nd_ep4", "nd_pp_ep", "nd_ep_tp"}
PUBLISHED_SHAPES = set(PUBLISHED)
CPU_HOST = HostFacts(cuda_devices=0, nccl=False, gloo=True, mpi=False)


pytestmark = pytest.mark.usefixtures("hydra_conf")


def test_every_group_has_options():
    assert {"strategy", "model", "data", "optim"} <= set(GROUPS)
    assert len(OPTIONS) >= 8


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_option_composes_and_instantiates(group: str, option: str, tmp_path: Path):
    """Each option with the rest of the default config (a compatible dataset for text models), built
    on real-format files where the dataset reads files."""
    from hydra.utils import instantiate

    overrides = [f"{group}={option}"]
    if group == "model" and option in TEXT_MODELS:
        overrides.append("data=imdb")
    if group == "model" and option in GPT_MODELS | PUBLISHED_SHAPES:
        overrides += ["data=synthetic_tokens", "task=lm"]
    if group == "model" and option in PUBLISHED_SHAPES:  # windows shorter than their context
        overrides.append("data.block_size=64")
    if group == "data" and option == "imdb":
        overrides.append("model=gcnn")
    if (group, option) == ("data", "synthetic_regression"):
        overrides += ["model=toy", "task=regression"]
    if (group, option) == ("task", "regression"):
        overrides += ["model=toy", "data=synthetic_regression"]
    if group == "data" and option in TOKEN_DATA:  # a model that reads token ids, and the task for them
        overrides += ["model=gpt_tiny", "task=lm"]
    if (group, option) == ("task", "lm"):
        overrides += ["model=gpt_tiny", "data=synthetic_tokens"]
    if group == "strategy" and option in EXPERT_PARALLEL:  # a model with experts, ranks to spread them
        overrides += ["model=gpt_moe_tiny", "data=synthetic_tokens", "task=lm", "dist.nprocs=4"]
    if (group, option) == ("data", "text_files"):
        (tmp_path / "corpus.txt").write_text("A corpus of one's own.\n" * 100)
        overrides.append(f"data.path={tmp_path / 'corpus.txt'}")
    data = (
        option
        if group == "data"
        else next((o.split("=")[1] for o in overrides if o.startswith("data=")), None)
    )
    if data in WRITERS:
        WRITERS[data](tmp_path)
        overrides.append(f"data.root={tmp_path}")
    cfg = compose(config_name="config", overrides=overrides)
    source = instantiate(cfg.data)
    assert isinstance(source, DataSource)
    source.check()
    with torch.device("meta" if option in PUBLISHED_SHAPES else "cpu"):
        model = models.build(cfg.model, source.info())
    assert sum(p.numel() for p in model.parameters()) > 0
    tasks.build(cfg.task).check(source.info().targets)
    optimizer = optim.build(model.parameters(), cfg.optim)
    assert optimizer.param_groups[0]["lr"] == cfg.optim.lr
    p = plan(cfg, CPU_HOST)
    assert p.global_batch == cfg.trainer.batch_size


def test_misspelt_field_fails_at_composition():
    with pytest.raises(Exception, match=r"trainer\.epoch"):
        compose(config_name="config", overrides=["trainer.epoch=3"])


def test_wrong_type_fails_at_composition():
    with pytest.raises(Exception, match="batch_size"):
        compose(config_name="config", overrides=["trainer.batch_size=big"])


def test_ddp_plan_on_cpu_uses_two_gloo_workers():
    cfg = compose(config_name="config", overrides=["strategy=ddp"])
    p = plan(cfg, CPU_HOST)
    assert (p.launcher, p.backend, p.world_size, p.per_rank_batch) == ("spawn", "gloo", 2, 32)


def test_help_lists_every_group_and_option():
    text = help_text(conf_dir())
    for group, option in OPTIONS:
        assert group in text
        assert option in text


def test_help_describes_each_option_in_whole_sentences():
    """Each option's --help line is the first sentence of its YAML header, however many comment lines
    that sentence takes: never cut where the first line ends."""
    text = help_text(conf_dir())
    described = {}
    group = None
    for line in text.splitlines():
        if line.startswith("  ") and not line.startswith("   ") and line.endswith(":"):
            group = line.strip()[:-1]
        elif group is not None and line.startswith("    ") and not line.startswith("     "):
            option, _, description = line.strip().partition(" ")
            described[group, option] = description.strip()
        elif not line.strip():
            group = None
    for group, option in OPTIONS:
        description = described[group, option]
        header = " ".join(
            line.lstrip("# ").strip()
            for line in itertools.takewhile(
                lambda line: line.startswith("#"),
                (Path(conf_dir()) / group / f"{option}.yaml").read_text().splitlines(),
            )
            if not line.startswith("# @package")
        )
        assert description.endswith("."), f"{group}={option}: {description!r} stops mid-sentence"
        assert header.startswith(description), (group, option, description)


def _table_rows(page: Path, heading: str) -> dict[str, list[str]]:
    """The first table under `heading` on `page`: each row's name (its first cell, `code` or a
    [link]; the header row has neither) -> every `name` in the rest of the row."""
    text = ("\n" + page.read_text()).split(f"\n{heading}\n", 1)[1]
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        if not line.startswith("|"):
            if rows:
                break
            continue
        first, *rest = (cell.strip() for cell in line.strip("|").split("|"))
        name = re.match(r"`([\w.]+)`|\[([\w.]+)\]", first)
        if name:
            rows[name[1] or name[2]] = re.findall(r"`([\w.]+)`", " | ".join(rest))
    return rows


def test_the_docs_option_tables_list_every_option_of_every_group():
    """getting-started's Options table has a row per group with exactly its options, the strategies
    page's table lists every strategy option, and comparing's Presets table every experiment."""
    docs = Path(__file__).resolve().parents[1] / "docs"
    options = {g: {o for group, o in OPTIONS if group == g} for g in GROUPS}
    table = _table_rows(docs / "getting-started.md", "## Options")
    shown = {g for g in GROUPS if options[g] and g != "experiment"}
    assert set(table) == shown, (set(table), shown)
    for group in shown:
        assert set(table[group]) == options[group], group
    by_strategy = _table_rows(docs / "strategies" / "index.md", "# Strategies")
    assert {o for listed in by_strategy.values() for o in listed} >= options["strategy"]
    presets = _table_rows(docs / "comparing.md", "## Presets")
    assert set(presets) == options["experiment"], set(presets) ^ options["experiment"]


def test_slurm_launcher_composes_and_jobs_are_checked_against_the_slurm_node(tmp_path, monkeypatch):
    from hydra.utils import get_class

    from ddpexp.composition import remote_host

    sbatch = tmp_path / "sbatch"  # a Slurm login node: sbatch on PATH
    sbatch.write_text("#!/bin/sh\n")
    sbatch.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")

    cfg = compose(
        config_name="config",
        overrides=["hydra/launcher=slurm", "strategy=ddp", "backend=nccl"],
        return_hydra_config=True,
    )
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher") and launcher.nodes == 1
    assert get_class(launcher._target_).__name__ == "SlurmLauncher"  # the plugin is installed
    host = remote_host(cfg)
    assert host.cuda_devices == launcher.gpus_per_node
    p = plan(cfg, host)  # nccl is fine on the GPU node, although this machine has none
    assert (p.backend, p.world_size) == ("nccl", launcher.gpus_per_node)
    local = compose(config_name="config", return_hydra_config=True)
    assert remote_host(local) is None


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (
            ["strategy=ddp", "dist.nprocs=3"],
            ["3 processes x 1 device(s) need 3 GPUs; 2 are visible", "dist.nprocs<=2"],
        ),
        (
            ["strategy=ddp_mp", "dist.nprocs=2", "model=mlp"],
            ["2 processes x 2 device(s) need 4 GPUs", "dist.nprocs<=1"],
        ),
    ],
)
def test_more_processes_than_gpus_is_refused(overrides: list[str], words: list[str]):
    from ddpexp.errors import UserError

    gpu_host = HostFacts(cuda_devices=2, nccl=True, gloo=True, mpi=False)
    cfg = compose(config_name="config", overrides=[*overrides, "device=cuda"])
    with pytest.raises(UserError) as refused:
        plan(cfg, gpu_host)
    assert all(w in str(refused.value) for w in words), str(refused.value)


FP16_ON_GPUS = {  # strategy overrides -> whether fp16 on 4 GPUs is refused before anything starts
    ("strategy=ddp",): False,
    ("strategy=fsdp",): False,
    ("strategy=nd",): False,  # FSDP only: the engine's step, with its loss scaler
    ("strategy=nd", "strategy.tp=2", "model=gpt_tiny", "task=lm", "data=synthetic_tokens"): True,
    ("strategy=nd", "strategy.pp=2"): True,
    ("strategy=pipeline",): True,
    ("strategy=ps", "dist.nprocs=2", "backend=gloo"): True,
    ("strategy=local_sgd",): True,
    ("strategy=diloco",): True,
}


@pytest.mark.parametrize(
    ("overrides", "refused"), FP16_ON_GPUS.items(), ids=[" ".join(o) for o in FP16_ON_GPUS]
)
def test_fp16_where_the_strategy_cannot_scale_losses_is_refused_before_anything_starts(
    overrides: tuple[str, ...], refused: bool
):
    """A strategy that runs its own training step (no loss scaler), or whose ranks step apart (a
    skipped step on one rank alone), refuses fp16 in pre-flight, on a GPU host, with the way out; it
    was refused only once the workers had started and built the model."""
    from ddpexp.errors import UserError

    gpu_host = HostFacts(cuda_devices=4, nccl=True, gloo=True, mpi=False)
    cfg = compose(config_name="config", overrides=[*overrides, "device=cuda", "trainer.precision=fp16"])
    if not refused:
        plan(cfg, gpu_host)
        return
    with pytest.raises(UserError) as error:
        plan(cfg, gpu_host)
    assert "trainer.precision" in str(error.value) and "bf16" in str(error.value), str(error.value)


def test_checkpoint_on_signal_under_torchrun_is_refused_with_the_way_out():
    """torchrun stops its workers itself on SIGTERM, before they could save: refused, not ignored."""
    from ddpexp.errors import UserError
    from ddpexp.plan import ExternalWorld

    cfg = compose(config_name="config", overrides=["strategy=ddp", "trainer.checkpoint_on_signal=true"])
    with pytest.raises(UserError) as refused:
        plan(cfg, CPU_HOST, external=ExternalWorld(world_size=2, local_world_size=2))
    assert "trainer.checkpoint_on_signal" in str(refused.value) and "python -m ddpexp" in str(refused.value)
    plan(cfg, CPU_HOST)  # self-launched: fine
