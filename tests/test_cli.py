"""The command line as a user meets it: help, --cfg, and one-line refusals that start nothing.

The refusal table runs `ddpexp.cli.main` in this process (one torch import instead of one per case);
the tests below it go through a real `python -m ddpexp` subprocess, exit code and stderr included."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import psutil
import pytest
import torch

from ddpexp import cli

GPT_LM = ["model=gpt_tiny", "data=python_stdlib", "task=lm"]  # 4 stages: embedding, 2 blocks, head
MOE = ["model=gpt_moe_tiny", "data=python_stdlib", "task=lm"]
REFUSALS = [
    # (overrides, words the one-line error must contain)
    (
        ["model=gpt_tiny", *MOE[1:], "strategy=nd", "strategy.ep=2"],
        ["strategy.ep", "has none", "gpt_moe_small"],
    ),
    (
        [*MOE, "strategy=nd", "strategy.dp_shard=2", "strategy.ep=4"],
        ["strategy.ep", "divisor of 2", "dist.nprocs"],
    ),
    (
        [*MOE, "strategy=nd", "strategy.ep=8", "dist.nprocs=8"],
        ["strategy.ep", "4 experts", "model.moe.experts"],
    ),
    ([*MOE, "strategy=nd", "strategy.ep=0"], ["strategy.ep", "positive"]),
    ([*MOE, "strategy=nd", "strategy.cp=2"], ["strategy.cp", "whole sequences", "strategy.cp=1"]),
    (
        [*MOE, "model.moe.ffn_dim=90", "strategy=nd", "strategy.tp=4", "dist.nprocs=4"],
        ["model.moe.ffn_dim", "90 hidden units of each expert", "multiple of strategy.tp=4"],
    ),
    ([*MOE, "model.moe.top_k=5"], ["model.moe.top_k", "4 there are", "top_k<=4"]),
    ([*MOE, "model.moe.capacity_factor=0"], ["model.moe.capacity_factor", "null for dropless"]),
    (["task=regression"], ["task=regression", "class labels", "task=classification"]),
    (["model=toy", "data=synthetic_regression"], ["task=classification", "float values", "task=regression"]),
    (["checkpoint.best_metric=eval/mse"], ["checkpoint.best_metric", "eval/mse", "eval/acc"]),
    (["task.topk=1"], ["task.topk", "2 or more"]),
    (["trainer.threads=0"], ["trainer.threads", "must be"]),
    (["trainer.time_comm_every_steps=0"], ["trainer.time_comm_every_steps", "must be"]),
    (["trainer.repeats=3"], ["trainer.repeats", "add -m"]),
    (["task=nosuch"], ["task", "nosuch", "classification"]),
    (["commbench.smoke=true"], ["commbench.smoke", "collective benchmark", "python -m ddpexp.commbench"]),
    (["--epochs", "3"], ["--epochs is not an option", "key=value", "trainer.epochs=3"]),
    (["strategy=ddp", "backend='cpu:gloo,cuda:nccl'"], ["backend", "NCCL", "CPU", "backend=gloo"]),
    (
        ["strategy=ddp", "dist.nprocs=1000", "trainer.batch_size=1000"],
        ["dist.nprocs", "cores", "oversubscribe"],
    ),
    (["strategy=ddp", "dist.master_addr=no-such-host.invalid"], ["dist.master_addr", "no-such-host.invalid"]),
    (["data=synthetic", "data.num_train=32"], ["trainer.batch_size", "no optimizer step", "<=32"]),
    (["data=synthetic", "data.num_eval=0"], ["eval split is empty", "data"]),
    (["strategy=fsdp", "strategy.mixed_precision=fp16"], ["strategy.mixed_precision", "CUDA", "bf16"]),
    (["strategy=fsdp", "++strategy.device_ids=[0]"], ["device_ids", "strategy=dp"]),
    (["strategy=ddp", "strategy.offload=true"], ["strategy.offload", "strategy=fsdp, strategy=nd"]),
    (["strategy=fsdp", "strategy.mixed_precision=fp8"], ["mixed_precision", "bf16", "fp16"]),
    (
        ["strategy=naive_allreduce", "++strategy.comm_hook=fp16"],
        [
            "strategy.comm_hook",
            "not in 'NaiveAllreduceConfig'",
            "strategy=ddp, strategy=ddp_mp, strategy=zero",
        ],
    ),
    (["strategy=fsdp", "strategy.comm_hook=bf16"], ["strategy.comm_hook", "strategy=ddp"]),
    (["strategy=ps", "dist.nprocs=1"], ["dist.nprocs", "a server and at least one worker", "dist.nprocs=3"]),
    (["strategy=ddp", "strategy.mode=async"], ["strategy.mode", "not in 'DdpConfig'", "strategy=ps"]),
    (["strategy=ps", "strategy.sync_bn=true"], ["strategy.sync_bn", "not in 'PsConfig'", "strategy=ddp"]),
    (["strategy=ps", "strategy.mode=hogwild"], ["strategy.mode", "hogwild", "sync, async"]),
    (["strategy=ddp", "strategy.comm_hook=int8"], ["comm_hook", "none, fp16, bf16, powersgd"]),
    (["strategy=zero", "strategy.powersgd_rank=0"], ["strategy.powersgd_rank", "> 0"]),
    (
        ["strategy=ddp", "strategy.comm_hook=powersgd", "strategy.powersgd_start_iter=1"],
        ["strategy.powersgd_start_iter", "2 or more"],
    ),
    (["+trainer.fast_dev_run=true"], ["trainer.fast_dev_run", "TrainerConfig", "+"]),
    (["++trainer.epochz=3"], ["epochz", "did you mean trainer.epochs?"]),
    (["+nosuch=1"], ["nosuch", "top level"]),
    (["experiment=dp_vs_ddp_vs_syncbn"], ["experiment=dp_vs_ddp_vs_syncbn", "sweep", "-m"]),
    (["backend=nosuch"], ["backend", "nosuch", "gloo"]),
    (["backend=gloo"], ["backend=gloo", "strategy=single", "strategy=ddp"]),
    (["strategy=ddp", "trainer.batch_size=65"], ["trainer.batch_size", "65", "2"]),
    (["model=resnet99"], ["resnet99", "convnet", "mlp"]),
    (["trainer.epoch=3"], ["trainer.epoch"]),
    (["trainer.batch_size=big"], ["batch_size", "big"]),
    (["strategy=ddp", "backend=nccl"], ["nccl", "backend=gloo"]),
    (["optim.lr=-1"], ["optim.lr"]),
    (["strategy=ddp,single"], ["-m"]),
    (["-m", "strategy=ddp", "trainer.batch_size=64,65"], ["trainer.batch_size", "65"]),
    (["strategy=ddp", "backend=mpi"], ["MPI", "backend=gloo"]),
    (["strategy=ddp", "backend=tcp"], ["backend", "cpu:gloo,cuda:nccl"]),
    (["strategy.sync_bn=true"], ["strategy.sync_bn", "strategy=ddp"]),
    (["strategy=dp", "strategy.sync_bn=true"], ["strategy.sync_bn", "dp"]),
    (["-m", "strategy=single,ddp", "strategy.sync_bn=true"], ["strategy.sync_bn"]),
    (["strategy=ddp_mp", "strategy.stages=3", "model=mlp"], ["strategy.stages", "at most 2"]),
    (["strategy=pipeline", "strategy.stages=3", "model=mlp"], ["strategy.stages", "at most 2"]),
    (
        ["strategy=pipeline", "strategy.microbatches=3"],
        ["strategy.microbatches", "per-rank batch 64", "3 micro-batches", "strategy.microbatches=2"],
    ),
    (["strategy=pipeline", "dist.nprocs=3"], ["dist.nprocs", "2 stages x 1 replica", "dist.nprocs=2"]),
    (
        ["strategy=pipeline", "strategy.replicas=2", "dist.nprocs=2"],
        ["dist.nprocs", "2 stages x 2 replica", "dist.nprocs=4"],
    ),
    (
        ["strategy=pipeline", "strategy.schedule=1f1b", "strategy.microbatches=1"],
        ["1F1B", "strategy.microbatches>=2", "strategy.schedule=gpipe"],
    ),
    (["strategy=pipeline", "strategy.schedule=zb"], ["strategy.schedule", "gpipe, 1f1b"]),
    (
        ["strategy=pipeline", "strategy.schedule=zbv", "strategy.stages_per_rank=3"],
        ["zbv runs exactly 2 stages per rank", "strategy.stages_per_rank", "interleaved_1f1b"],
    ),
    (
        ["strategy=pipeline", "strategy.stages_per_rank=2"],
        ["gpipe runs one stage per rank", "interleaved_1f1b"],
    ),
    (
        ["strategy=pipeline", "strategy.schedule=zbv", "trainer.activation_checkpointing=selective", *GPT_LM],
        ["trainer.activation_checkpointing", "backpropagated once", "=full", "interleaved_1f1b"],
    ),
    (
        ["strategy=pipeline", "strategy.schedule=interleaved_1f1b", "model=mlp"],
        ["at most 2 stages, not 2 x 2 per rank", "strategy.stages<=1", "fewer strategy.stages_per_rank"],
    ),
    (
        ["strategy=nd", "strategy.pp=2", "strategy.schedule=dualpipev", "strategy.microbatches=2", *GPT_LM],
        ["DualPipeV needs at least as many micro-batches as stages (2 ranks x 2) (4)", "microbatches>=4"],
    ),
    (
        [
            "strategy=pipeline",
            "strategy.schedule=interleaved_1f1b",
            "strategy.microbatches=5",
            "trainer.batch_size=60",
            *GPT_LM,
        ],
        ["rounds of 2", "strategy.microbatches=6"],
    ),
    (["strategy=pipeline", "strategy.sync_bn=true"], ["strategy.sync_bn", "not in 'PipelineConfig'"]),
    (["strategy=ddp", "strategy.microbatches=4"], ["strategy.microbatches", "strategy=pipeline"]),
    (
        ["strategy=ddp_mp", "model=mlp", "~model.hidden", "model._target_=tests.user_models.unsplittable"],
        ["stages()", "strategy=ddp"],
    ),
    (["strategy=dp", "strategy.device_ids=[0,1]"], ["strategy.device_ids", "CPU"]),
    (["strategy=ddp", "strategy.device_ids=[0]"], ["strategy.device_ids", "strategy=dp"]),
    (["strategy=ddp", "strategy.stages=2"], ["strategy.stages", "not in 'DdpConfig'", "strategy=ddp_mp"]),
    (["++strategy.sync_bn=true"], ["strategy.sync_bn", "not in 'SingleConfig'", "strategy=ddp"]),
    (["trainer.epochz=3"], ["trainer.epochz", "not in 'TrainerConfig'", "did you mean trainer.epochs?"]),
    (["stratgy=ddp"], ["stratgy", "did you mean strategy?"]),
    (["trainer.precision=16"], ["trainer.precision", "expected one of [fp32, bf16, fp16, fp8]"]),
    (["optim.scale_rule=cubic"], ["optim.scale_rule", "expected one of [none, linear, sqrt]"]),
    (["checkpoint.best_mode=best"], ["checkpoint.best_mode", "expected one of [max, min]"]),
    (["device=tpu"], ["device", "expected one of [auto, cpu, cuda]"]),
    (["trainer.mode=test"], ["trainer.mode", "expected one of [train, eval]"]),
    (
        ["hydra.run.dir=runs/lr=0.1"],
        ["cannot parse override 'hydra.run.dir=runs/lr=0.1'", """'hydra.run.dir="runs/lr=0.1"'"""],
    ),
    (["-m", "optim.lr=interval(0.001,0.1)"], ["interval", "hydra/sweeper=optuna"]),
    (["strategy=ddp", "device=cuda"], ["device", "device=cpu"]),
    (["-m", "hydra/launcher=slurm", "hydra.launcher.nodes=2"], ["hydra.launcher.nodes", "torchrun"]),
    (["strategy=ddp", "init=bogus"], ["init", "bogus"]),
    (
        ["strategy=ddp", "data=mnist", "data.root=/nonexistent"],
        ["/nonexistent", "data.download=true", "data=digits"],
    ),
    (["strategy=ddp", "data=imdb", "data.root=/nonexistent"], ["aclImdb", "data=digits"]),
    (["model=gcnn"], ["token ids", "data=imdb"]),
    (["trainer.precision=fp16"], ["trainer.precision", "CUDA", "bf16"]),
    (["trainer.mode=eval"], ["trainer.resume"]),
    (["strategy=ddp", "trainer.accumulate=3"], ["trainer.batch_size", "accumulated", "66"]),
    (["optim.schedule=linear"], ["optim.schedule", "cosine"]),
    (["strategy=dp", "strategy.static_graph=true"], ["strategy.static_graph", "strategy=ddp"]),
    (["strategy.bucket_cap_mb=5"], ["strategy.bucket_cap_mb", "naive_allreduce"]),
    (
        ["strategy=ddp", "strategy.algorithm=ring"],
        ["strategy.algorithm", "not in 'DdpConfig'", "strategy=naive_allreduce"],
    ),
    (["strategy=naive_allreduce", "strategy.algorithm=tree"], ["strategy.algorithm", "[collective, ring]"]),
    (["-m", "data=mnist,cifar10", "data.root=/x"], ["data.root", "/x", "mnist files not found"]),
    (["-m", "experiment=dp_vs_ddp_vs_syncbn", "strategy.sync_bn=true"], ["strategy.sync_bn", "++key=value"]),
    (["strategy=sgd"], ["sgd", "ddp", "single"]),
    (
        ["-m", "hydra/launcher=slurm", "strategy=single,ddp"],
        ["hydra/launcher=slurm", "no Slurm", "submitit_local"],
    ),
    (["data=mnist2"], ["mnist2", "digits"]),
    (["trainer.epochs=0"], ["trainer.epochs", "> 0"]),
    (["trainer.accumulate=0"], ["trainer.accumulate", "> 0"]),
    (["optim.lr=nan"], ["optim.lr", "finite"]),
    (["optim.lr=inf"], ["optim.lr", "finite"]),
    (["optim=adamw", "optim.betas=[0.9,inf]"], ["optim.betas[1]", "finite"]),
    (["optim.momentum=-1"], ["optim.momentum", "SGD refuses it", "Invalid momentum value: -1"]),
    (["optim.weight_decay=-1"], ["optim.weight_decay", "SGD refuses it"]),
    (["optim.momentum=0", "optim.nesterov=true"], ["optim.nesterov", "optim.momentum > 0"]),
    (["optim=adamw", "optim.betas=[0.9,1.5]"], ["optim.betas", "AdamW refuses it", "beta"]),
    (["optim=adamw", "optim.eps=-1"], ["optim.eps", "AdamW refuses it"]),
    (["trainer.batch_size=0"], ["trainer.batch_size"]),
    (["strategy=ddp", "dist.nprocs=0"], ["dist.nprocs"]),
    (["strategy=ddp", "dist.max_restarts=-1"], ["dist.max_restarts", ">= 0"]),
    (["strategy=ddp", "init=tcp", "dist.master_addr=10.0.0.300"], ["dist.master_addr", "10.0.0.300"]),
    (["strategy=ddp", "init=tcp", "dist.master_addr=node1:29500"], ["dist.master_port=29500"]),
    (["strategy=ddp", "dist.master_port=70000"], ["dist.master_port", "70000"]),
    (["--local-rank=0", "strategy=ddp"], ["--local-rank", "torch.distributed.launch", "RANK", "self-launch"]),
    (["--local_rank", "x", "strategy=ddp"], ["--local-rank", "'x' is not a rank"]),
    (["strategy=ddp", "dist.nnodes=2"], ["dist.master_port", "dist.nnodes=2", "dist.master_port=29500"]),
    (
        ["strategy=ddp", "dist.nnodes=2", "dist.node_rank=2", "dist.master_port=29500"],
        ["dist.node_rank", "outside 0..1", "from 0 to 1"],
    ),
    (["strategy=ddp", "dist.node_rank=-1"], ["dist.node_rank", "-1", "dist.node_rank from 0 to 0"]),
    (["strategy=ddp", "dist.nnodes=0"], ["dist.nnodes", "> 0"]),
    (["dist.nnodes=2", "dist.master_port=29500"], ["dist.nnodes", "'single'", "strategy=ddp"]),
    (
        ["strategy=ddp", "dist.nnodes=2", "dist.master_port=29500", "dist.max_restarts=1"],
        ["dist.max_restarts", "trainer.resume=auto"],
    ),
    (["-m", "strategy=ddp", "dist.nnodes=2", "dist.master_port=29500"], ["sweep", "machines"]),
    (
        ["strategy=ddp", "init=file", "dist.init_file=/nonexistent/dir/rdzv"],
        ["dist.init_file", "/nonexistent/dir/rdzv", "does not exist"],
    ),
    (
        ["strategy=ddp", "init=file", "dist.init_file=/sys/rdzv"],
        ["dist.init_file", "cannot create /sys/rdzv", "a directory you can write to"],
    ),
    (
        ["trainer.resume=/nonexistent/step-1.pt"],
        ["trainer.resume", "/nonexistent/step-1.pt", "does not exist"],
    ),
    # An override after an option is left over by argparse: said so, with the order that works.
    (
        ["trainer.max_steps=3", "--config-dir", "mine", "model=mlp"],
        [
            "model=mlp comes after an option",
            "python -m ddpexp --config-dir mine trainer.max_steps=3 model=mlp",
        ],
    ),
    # Builders that make nothing to train, caught before a run directory is made.
    (["model._target_=builtins.dict"], ["model._target_: builtins.dict built a dict, not a torch.nn.Module"]),
    (["model._target_=torch.nn.Identity"], ["model._target_", "without trainable parameters"]),
    (["model._target_=null"], ["model._target_: names no builder"]),
    # Non-finite settings, whatever their section (a nan threshold compares false with everything).
    (["trainer.clip_grad_norm=nan"], ["trainer.clip_grad_norm: must be a finite number, got nan"]),
    (["strategy=diloco", "strategy.outer_lr=inf"], ["strategy.outer_lr: must be a finite number, got inf"]),
    (["dist.hang_timeout_s=nan"], ["dist.hang_timeout_s: must be a finite number"]),
    (["optim.lr=1e400"], ["optim.lr: must be a finite number, got inf"]),
    (["optim=adamw", "optim.betas=[0.9,nan]"], ["optim.betas[1]: must be a finite number"]),
    # Schedules that would leave the learning rate negative or above its peak.
    (["optim.schedule=cosine", "optim.min_lr_ratio=-1"], ["optim.min_lr_ratio", "outside 0..1"]),
    (["optim.schedule=cosine", "optim.min_lr_ratio=2"], ["optim.min_lr_ratio", "outside 0..1"]),
    (["optim.schedule=step", "optim.gamma=-1"], ["optim.gamma", "outside (0, 1]"]),
]


def refuse(cwd: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """Run the command line in this process; it must exit 2 with one line, start and create nothing."""
    monkeypatch.chdir(cwd)
    monkeypatch.delenv("DDPEXP_T0", raising=False)
    capsys.readouterr()
    already = set(psutil.Process().children())  # e.g. an earlier test's forkserver
    with pytest.raises(SystemExit) as exited:
        cli.main(list(args))
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddpexp: error: "), err
    assert set(psutil.Process().children()) <= already  # nothing launched
    assert list(cwd.iterdir()) == []  # no run or sweep directory
    return lines[0]


@pytest.mark.parametrize(("args", "words"), REFUSALS, ids=[" ".join(a) for a, _ in REFUSALS])
def test_bad_input_is_refused_in_one_line_before_anything_starts(
    tmp_path: Path, monkeypatch, capsys, args, words
):
    line = refuse(tmp_path, monkeypatch, capsys, *args)
    for word in words:
        assert word in line, (word, line)


def test_a_pinned_port_in_use_is_refused_naming_it(tmp_path: Path, monkeypatch, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = refuse(tmp_path, monkeypatch, capsys, "strategy=ddp", f"dist.master_port={port}")
    assert "dist.master_port" in line and str(port) in line and "already in use" in line


def test_a_corrupt_checkpoint_is_refused(tmp_path: Path, tmp_path_factory, monkeypatch, capsys):
    broken = tmp_path_factory.mktemp("elsewhere") / "broken.pt"
    broken.write_bytes(b"not a checkpoint")
    line = refuse(tmp_path, monkeypatch, capsys, f"trainer.resume={broken}")
    assert "trainer.resume" in line and str(broken) in line and "not a readable checkpoint" in line


def test_a_checkpoint_of_another_model_is_refused_naming_the_keys(
    tmp_path, tmp_path_factory, monkeypatch, capsys
):
    from ddpexp.models.mlp import mlp

    saved = tmp_path_factory.mktemp("elsewhere") / "mlp.pt"
    torch.save(mlp(num_classes=10, input_shape=[1, 28, 28], hidden=[32]).state_dict(), saved)
    line = refuse(tmp_path, monkeypatch, capsys, "model=convnet", f"trainer.resume={saved}")
    assert "does not fit the configured model" in line and "missing" in line and "unexpected" in line
    assert "more)" in line  # long key lists are cut short
    line = refuse(tmp_path, monkeypatch, capsys, "model=mlp", "model.hidden=[16]", f"trainer.resume={saved}")
    assert "different shapes (checkpoint vs model) body.1.weight (32, 784) vs (16, 784)" in line


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("rank1:step5:explode", ["rank<R>:step<S>"]),
        ("rank2:step5:kill", ["can never fire", "2 rank(s)"]),
        # the README's old example: digits at batch 64 on 2 ranks saves at steps 22, 44, ... only
        ("rank0:step10:kill_in_save", ["no checkpoint is saved at step 10", "22"]),
        ("rank1:step99999:raise", ["can never fire", "takes 220 optimizer steps"]),
        ("rank1:step220:hang_forward", ["can never fire", "name a step <= 219"]),  # hangs in the next
    ],
)
def test_a_malformed_fault_is_refused(tmp_path: Path, monkeypatch, capsys, spec: str, words: list[str]):
    monkeypatch.setenv("DDPEXP_FAULT", spec)
    line = refuse(tmp_path, monkeypatch, capsys, "strategy=ddp")
    assert all(w in line for w in words), line


def test_a_run_never_reuses_a_directory_that_holds_results(tmp_path, tmp_path_factory, monkeypatch, capsys):
    run_dir = tmp_path_factory.mktemp("taken")
    (run_dir / "metrics.json").write_text('{"status": "completed"}')
    line = refuse(tmp_path, monkeypatch, capsys, f"hydra.run.dir={run_dir}")
    assert "already holds a run" in line
    assert (run_dir / "metrics.json").read_text() == '{"status": "completed"}'
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.json"]


LLAMA_1B = ["model=llama3_2_1b", "task=lm", "data=synthetic_tokens", "data.block_size=128", "optim=adamw"]


@pytest.mark.parametrize(
    ("available_mib", "args", "words"),
    [
        (
            300,
            ["strategy=ddp", "dist.nprocs=4", "trainer.max_steps=1"],
            ["4 ranks", "300 MiB", "dist.nprocs<=2"],
        ),
        (
            8192,
            ["strategy=ddp", "dist.nprocs=1000", "trainer.batch_size=1000", "dist.oversubscribe=true"],
            ["1000 ranks", "8,192 MiB", "dist.nprocs<=81"],
        ),
        # #50 item 7: in process, and the states a rank holds beside its parameters (AdamW's 2 moments)
        (16384, ["strategy=single", *LLAMA_1B], ["the run needs", "18,857 MiB a rank", "strategy=fsdp"]),
        (16384, ["strategy=dp", *LLAMA_1B], ["the run needs", "18,857 MiB a rank"]),
        (
            24576,
            ["strategy=ddp", "dist.nprocs=2", *LLAMA_1B],
            ["2 ranks", "37,914 MiB", "18,857 MiB a rank", "dist.nprocs<=1"],
        ),
    ],
)
def test_ranks_whose_model_states_do_not_fit_in_memory_are_refused_with_the_numbers(
    tmp_path: Path, monkeypatch, capsys, available_mib: int, args: list[str], words: list[str]
):
    """Before anything starts, in process too: each rank's parameters, gradients and optimizer state
    as the memory model counts them, plus each worker process's own baseline, against the memory
    available (dist.oversubscribe waives the cores check only). Llama 3.2 1B with AdamW is 18,857 MiB a
    rank unsharded: the 24 GiB VM used to start it, twice over under ddp."""
    real = psutil.virtual_memory
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real()._replace(available=available_mib << 20))
    line = refuse(tmp_path, monkeypatch, capsys, *args)
    assert "dist.memory_check" in line and all(word in line for word in words), line


def test_the_memory_check_can_be_waived_knowingly(tmp_path: Path, monkeypatch, capsys):
    """dist.memory_check=false starts a run the check would refuse (memory to be freed meanwhile)."""
    real = psutil.virtual_memory
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real()._replace(available=1 << 10))
    line = refuse(tmp_path, monkeypatch, capsys, "trainer.max_steps=1")
    assert "dist.memory_check=false" in line
    from .conftest import run_here

    result = run_here(tmp_path, "trainer.max_steps=1", "trainer.epochs=1", "dist.memory_check=false")
    assert result.returncode == 0, result


def test_a_stale_rendezvous_file_is_refused(tmp_path: Path, tmp_path_factory, monkeypatch, capsys):
    stale = tmp_path_factory.mktemp("shared") / "rdzv"
    stale.write_text("")
    line = refuse(tmp_path, monkeypatch, capsys, "strategy=ddp", "init=file", f"dist.init_file={stale}")
    assert "dist.init_file" in line and "already exists" in line and stale.exists()


IMAGES = ["data=image_folder", "data.image_size=32", "model=mlp", "trainer.batch_size=4"]


@pytest.mark.parametrize(
    ("damage", "words"),
    [
        ("empty class", ["flower1", "no images", ".png", "remove the folder"]),
        ("zero bytes", ["flower2/img3.png", "is empty", "replace or delete"]),
    ],
)
def test_an_image_folder_with_an_empty_class_or_image_is_refused_naming_it(
    tmp_path: Path, tmp_path_factory, monkeypatch, capsys, damage: str, words: list[str]
):
    from .fake_data import write_image_folder

    root = write_image_folder(tmp_path_factory.mktemp("data"), per_class=4)
    if damage == "empty class":
        for image in (root / "flower1").iterdir():
            image.unlink()
    else:
        (root / "flower2" / "img3.png").write_bytes(b"")
    line = refuse(tmp_path, monkeypatch, capsys, *IMAGES, f"data.root={root}")
    assert "data.root" in line and all(word in line for word in words), line


@pytest.mark.parametrize("workers", [0, 2])
def test_an_image_that_does_not_decode_is_named_with_the_fix(tmp_path: Path, workers: int):
    """A cut-off PNG opens (its header is whole) but does not decode: only reading it finds that, in
    the run, which then stops with one line naming the file (read in DataLoader workers too)."""
    from .conftest import run_here
    from .fake_data import write_image_folder

    root = write_image_folder(tmp_path / "data", per_class=4)
    broken = root / "flower0" / "img2.png"
    broken.write_bytes(broken.read_bytes()[:200])
    run = [f"data.root={root}", "trainer.max_steps=1", f"loader.num_workers={workers}", "hydra.run.dir=run"]
    result = run_here(tmp_path, *IMAGES, *run)
    assert result.returncode == 2, result
    said = result.stdout + result.stderr
    assert f"error: data.root: {broken}: does not decode as an image" in said, result
    assert "replace or delete" in said and "Traceback" not in said, result


@pytest.mark.parametrize(
    ("damage", "words"),
    [
        ("t10k-labels-idx1-ubyte", ["t10k-labels-idx1-ubyte", "data.download=true"]),
        ("magic", ["train-images-idx3-ubyte", "bad magic number 0x00000801 (expected 0x00000803)"]),
    ],
)
def test_an_incomplete_or_corrupt_mnist_is_refused_naming_the_file(
    tmp_path: Path, tmp_path_factory, monkeypatch, capsys, damage: str, words: list[str]
):
    from .fake_data import write_mnist

    root = write_mnist(tmp_path_factory.mktemp("data"))
    raw = root / "MNIST" / "raw"
    if damage == "magic":
        images = raw / "train-images-idx3-ubyte"
        images.write_bytes(b"\0\0\x08\x01" + images.read_bytes()[4:])
    else:
        (raw / damage).unlink()
    line = refuse(tmp_path, monkeypatch, capsys, "data=mnist", f"data.root={root}")
    assert all(word in line for word in words), line


def test_a_yaml_syntax_error_in_your_config_dir_names_the_file_and_line(
    tmp_path: Path, tmp_path_factory, monkeypatch, capsys
):
    mine = tmp_path_factory.mktemp("conf") / "model" / "mine.yaml"
    mine.parent.mkdir()
    mine.write_text("# my model\n_target_: ddpexp.models.mlp.mlp\nhidden: [32, 16\nbatch_norm: false\n")
    line = refuse(tmp_path, monkeypatch, capsys, "--config-dir", str(mine.parent.parent), "model=mine")
    assert f"{mine}, line 4, column 11" in line and "expected ',' or ']'" in line, line
    assert "line 3" in line  # where the unclosed [ began


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (
            b"# caf\xe9 model\n_target_: ddpexp.models.mlp.mlp\n",
            ["is not UTF-8 text", "0xe9", "save the file"],
        ),
        (b"# a list\n- 1\n- 2\n", ["holds a YAML list where a config belongs", "key: value"]),
    ],
    ids=["latin-1", "a list"],
)
def test_a_config_file_that_is_not_utf8_or_not_a_mapping_is_named(
    tmp_path: Path, tmp_path_factory, monkeypatch, capsys, content: bytes, words: list[str]
):
    mine = tmp_path_factory.mktemp("conf") / "model" / "mine.yaml"
    mine.parent.mkdir()
    mine.write_bytes(content)
    line = refuse(tmp_path, monkeypatch, capsys, "--config-dir", str(mine.parent.parent), "model=mine")
    assert str(mine) in line and all(word in line for word in words), line


@pytest.mark.parametrize(("sweep", "setting"), [(False, "hydra.run.dir"), (True, "hydra.sweep.dir")])
def test_an_output_dir_under_a_read_only_directory_is_refused(
    tmp_path: Path, tmp_path_factory, monkeypatch, capsys, sweep: bool, setting: str
):
    import os

    locked = tmp_path_factory.mktemp("locked")
    locked.chmod(0o555)
    try:
        if os.access(locked, os.W_OK):
            # Root ignores permission bits, so here only the refusal is tested, not the kernel's verdict:
            # os.access answers for `locked` as it would for any other user.
            real = os.access
            monkeypatch.setattr(
                os,
                "access",
                lambda p, mode, **kw: not (Path(p) == locked and mode & os.W_OK) and real(p, mode, **kw),
            )
        args = ["-m", f"{setting}={locked}/out/sweep"] if sweep else [f"{setting}={locked}/out/run"]
        line = refuse(tmp_path, monkeypatch, capsys, *args)
    finally:
        locked.chmod(0o755)
    assert setting in line and f"{locked} is not writable" in line, line


@pytest.mark.parametrize("code", ["EACCES", "ENOSPC"])
def test_an_os_error_making_the_run_dir_is_one_line_naming_it(tmp_path: Path, monkeypatch, capsys, code: str):
    import errno
    import os

    from ddpexp import fsutil

    number = getattr(errno, code)

    def fail(directory: Path) -> None:
        raise OSError(number, os.strerror(number), str(directory))

    monkeypatch.setattr(fsutil, "claim", fail)
    line = refuse(tmp_path, monkeypatch, capsys, "hydra.run.dir=out/run")
    assert "hydra.run.dir" in line and "out/run" in line and os.strerror(number) in line, line


@pytest.mark.parametrize("multirun", [False, True])
def test_a_disk_with_a_few_kb_free_is_refused_before_anything_is_made(
    tmp_path: Path, monkeypatch, capsys, multirun: bool
):
    import shutil

    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=12 * 1024))
    setting = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    line = refuse(tmp_path, monkeypatch, capsys, *(["-m"] if multirun else []), f"{setting}=out/run")
    assert setting in line and "12 KiB free" in line and "free space" in line, line


def test_a_disk_that_fills_as_the_run_dir_is_set_up_leaves_nothing(tmp_path: Path, monkeypatch, capsys):
    """The disk fills between pre-flight and the first file of the run (Hydra's record of it,
    .hydra/config.yaml): one line, and the directories this command made are gone, from the command
    line and from ddpexp.run."""
    import errno
    import os

    import ddpexp
    from ddpexp import fsutil
    from ddpexp.errors import UserError

    def full(*args: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(fsutil, "_temporary_beside", full)  # every file ddpexp writes
    line = refuse(tmp_path, monkeypatch, capsys, "hydra.run.dir=out/run")
    assert "hydra.run.dir" in line and "out/run" in line and os.strerror(errno.ENOSPC) in line, line
    with pytest.raises(UserError, match="No space left on device"):
        ddpexp.run(["hydra.run.dir=out/run"])
    assert list(tmp_path.iterdir()) == []


def test_a_run_dir_below_a_file_is_refused(tmp_path: Path, tmp_path_factory, monkeypatch, capsys):
    a_file = tmp_path_factory.mktemp("elsewhere") / "notes.txt"
    a_file.write_text("")
    line = refuse(tmp_path, monkeypatch, capsys, f"hydra.run.dir={a_file}/run")
    assert "hydra.run.dir" in line and f"{a_file} is not a directory" in line, line


# What torch.distributed.launch sets besides --local-rank=N (torch >= 2.0 sets LOCAL_RANK too).
LAUNCH_ENV = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize(
    "argv",
    [
        ["--local-rank=1", "strategy=ddp"],
        ["--local-rank", "1", "strategy=ddp"],
        ["--local_rank=1", "strategy=ddp"],
        ["strategy=ddp", "--local_rank", "1"],
    ],
)
def test_torch_distributed_launch_local_rank_argument_becomes_local_rank(argv: list[str]):
    from ddpexp.launch.torchrun import take_local_rank

    env = dict(LAUNCH_ENV)
    assert take_local_rank(argv, env) == ["strategy=ddp"]
    assert env["LOCAL_RANK"] == "1"  # supplied where the launcher set none
    assert take_local_rank(argv, env) == ["strategy=ddp"]  # and agreeing where it did


def test_a_local_rank_argument_that_disagrees_with_the_launcher_is_refused():
    from ddpexp.errors import UserError
    from ddpexp.launch.torchrun import take_local_rank

    with pytest.raises(UserError, match="--local-rank=1 disagrees with LOCAL_RANK=0"):
        take_local_rank(["--local-rank=1"], {**LAUNCH_ENV, "LOCAL_RANK": "0"})


def test_help_lists_config_groups_with_one_line_each(capsys):
    cli.main(["--help"])
    out = capsys.readouterr().out
    for line in ("strategy", "single", "ddp", "model", "convnet", "data", "digits", "synthetic", "optim"):
        assert line in out
    assert "trainer.batch_size" in out


def test_cfg_job_prints_the_composed_config(tmp_path: Path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["ddpexp"])  # --cfg hands over to hydra.main, which reads argv
    with pytest.raises(SystemExit) as exited:
        cli.main(["--cfg", "job", "strategy=ddp"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert "name: ddp" in out and "batch_size: 64" in out and "sync_bn: false" in out
    assert list(tmp_path.iterdir()) == []


def test_console_script_is_installed():
    import shutil
    import sys

    script = Path(sys.executable).parent / "ddpexp"
    assert script.exists() or shutil.which("ddpexp")


def test_an_error_raised_while_ctrl_c_unwound_is_the_interrupt_not_a_refusal():
    """Ctrl-C inside a library's `with` block: its `finally` fails on the half-built state, and
    pre-flight would report that failure as a bad setting (seen: "model: 'NoneType' object has no
    attribute '_invalidate_flags_cache'"). The command line treats it as the Ctrl-C it is."""
    from ddpexp.errors import UserError, interrupted_within

    def refusal_after_interrupt() -> UserError:
        try:
            try:
                raise KeyboardInterrupt
            finally:
                raise AttributeError("'NoneType' object has no attribute '_invalidate_flags_cache'")
        except AttributeError as exc:
            try:
                raise UserError(str(exc), setting="model") from exc
            except UserError as refusal:
                return refusal

    assert interrupted_within(refusal_after_interrupt())
    try:
        raise UserError("bad", setting="model") from ValueError("bad")
    except UserError as plain:
        assert not interrupted_within(plain)


def test_ctrl_c_while_torch_is_still_importing_is_one_line_and_exit_130(tmp_path: Path):
    """Ctrl-C can land in the middle of `import torch` (the first seconds of a command on a busy
    machine); torch is then half-imported and importing it again fails. The command must still say
    one line and exit 130, so leaving may not import anything that imports torch (it did: a
    traceback ending in "duplicate registrations for aten.linspace", exit 1)."""
    import subprocess

    script = (
        "import sys\n"
        "from ddpexp import cli\n"
        "def interrupted(**kwargs):\n"
        "    sys.modules['torch'] = None  # what a torch import cut short leaves: importing it fails\n"
        "    raise KeyboardInterrupt\n"
        "cli.main = interrupted\n"
        "cli.console()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 130, done.stderr
    assert done.stderr == "ddpexp: interrupted before anything started\n"
