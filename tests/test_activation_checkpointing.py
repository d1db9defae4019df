"""Activation checkpointing (trainer.activation_checkpointing) and the activation memory it saves
(mem/activations_mb): the same parameters as without it under every strategy, the same names, and
fewer bytes held for the backward, counted exactly."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from ddpexp import activation_checkpointing as ac
from ddpexp.config import ActivationCheckpointing
from ddpexp.memory import ActivationMeter
from ddpexp.models.convnet import convnet
from ddpexp.models.mlp import mlp
from ddpexp.models.resnet import resnet18

from .conftest import TOLERANCE, made_once, metrics, run_here, weights
from .user_models import tower

MODES = list(ActivationCheckpointing)
SELECTIVE = [ActivationCheckpointing.selective, ActivationCheckpointing.selective_half]
STRATEGIES = ["single", "ddp", "fsdp", "zero", "pipeline", "ddp_mp"]
# Six equal blocks with BatchNorm (its running statistics must be updated once per step, not again
# when a block recomputes) on small synthetic images: the bytes of the blocks dominate.
TOWER = [
    "model._target_=tests.user_models.tower",
    "+model.width=128",
    "data=synthetic",
    "data.shape=[1,8,8]",
    "trainer.progress=false",
    "trainer.max_steps=5",
    "trainer.batch_size=64",
]


def one_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, meter: ActivationMeter) -> None:
    with meter.measure(model):
        nn.functional.cross_entropy(model(x), y).backward()


@pytest.mark.parametrize(
    ("build", "shape"),
    [
        (lambda: convnet(num_classes=10, input_shape=[1, 28, 28]), [1, 28, 28]),
        (lambda: resnet18(num_classes=10, input_shape=[3, 16, 16], cifar_stem=True), [3, 16, 16]),
        (lambda: tower(num_classes=10, input_shape=[1, 8, 8]), [1, 8, 8]),
    ],
    ids=["convnet", "resnet18", "tower"],
)
@pytest.mark.parametrize("mode", [ActivationCheckpointing.full, ActivationCheckpointing.selective])
def test_checkpointing_keeps_names_gradients_and_batchnorm_statistics(build, shape, mode):
    """One training step with checkpointing gives bitwise the gradients and BatchNorm running statistics
    of one without it, under the same state_dict keys (checkpoints and model.pt are interchangeable),
    and the blocks really run twice (their forward again in the backward)."""
    torch.manual_seed(0)
    plain = build()
    checkpointed = copy.deepcopy(plain)
    assert ac.apply(checkpointed, mode) == len(ac.declared_blocks(plain)) > 0
    assert list(checkpointed.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in checkpointed.named_modules()] == [n for n, _ in plain.named_modules()]
    calls = []
    first = next(m for m in ac.declared_blocks(checkpointed)[0].modules() if not list(m.children()))
    first.register_forward_hook(lambda *_: calls.append(1))
    x, y = torch.randn(4, *shape), torch.randint(0, 10, (4,))
    for model in (plain, checkpointed):
        one_step(model, x, y, ActivationMeter())
    assert len(calls) == 2  # the forward, and again in the backward
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name
    for (name, a), b in zip(plain.state_dict().items(), checkpointed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name  # running_mean, running_var, num_batches_tracked included


def test_the_blocks_are_the_declared_submodules_shard_units_first():
    """ResNet's stages() builds its stem and head as new containers (never called): only the layers
    that are submodules are checkpointed. A model with shard_units() is checkpointed by them, not by
    its stages()."""
    net = resnet18(num_classes=10, input_shape=[3, 16, 16])
    assert ac.declared_blocks(net) == [net.layer1, net.layer2, net.layer3, net.layer4]
    model = tower(num_classes=10, input_shape=[1, 8, 8])
    ac.apply(model, ActivationCheckpointing.full)
    assert [type(m).__name__ for m in (model.stem, model.blocks[0], model.head)] == [
        "Sequential",
        "CheckpointedSequential",
        "Linear",
    ]


def test_the_meter_counts_a_tiny_mlps_saved_tensors_by_hand():
    """Flatten -> Linear(784, 32) -> ReLU -> Linear(32, 10), cross-entropy, batch 8, inputs that need no
    gradient. Autograd keeps for the backward: the input (the first weight's gradient), the ReLU's
    output (its own backward and the second weight's gradient: one storage), log-softmax's output,
    the targets and the loss's weight total; parameters are not counted. The peak is at the end of the
    forward, and everything is let go by the end of the backward."""
    torch.manual_seed(0)
    model = mlp(num_classes=10, input_shape=[1, 28, 28], hidden=[32])
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    meter = ActivationMeter()
    one_step(model, x, y, meter)
    by_hand = 8 * 784 * 4 + 8 * 32 * 4 + 8 * 10 * 4 + 8 * 8 + 4
    assert meter.peak_bytes == by_hand
    assert meter.held_bytes == 0
    one_step(model, x[:4].clone(), y[:4].clone(), meter)  # a second measurement starts afresh
    assert meter.peak_bytes == 4 * 784 * 4 + 4 * 32 * 4 + 4 * 10 * 4 + 4 * 8 + 4
    one_step(model, x[:4], y[:4], meter)  # a view holds its whole storage: the 8 samples' bytes
    assert meter.peak_bytes == 8 * 784 * 4 + 4 * 32 * 4 + 4 * 10 * 4 + 8 * 8 + 4


def test_the_meter_counts_what_a_block_holds_again_while_it_recomputes():
    """One checkpointed block: during its backward it holds all it would have held without
    checkpointing, so full's peak is none's less only what was done with before: the block's output
    (the head's input) and the loss's tensors, counted by hand."""
    batch, width, classes = 4, 64, 10
    torch.manual_seed(0)
    plain = tower(num_classes=classes, input_shape=[1, 8, 8], width=width, depth=1)
    checkpointed = copy.deepcopy(plain)
    meters = {
        ActivationCheckpointing.none: ActivationMeter(),
        ActivationCheckpointing.full: ActivationMeter(),
    }
    ac.apply(checkpointed, ActivationCheckpointing.full, meter=meters[ActivationCheckpointing.full])
    x, y = torch.randn(batch, 1, 8, 8), torch.randint(0, classes, (batch,))
    for model, meter in zip((plain, checkpointed), meters.values(), strict=True):
        one_step(model, x, y, meter)
    done_with = batch * width * 4 + batch * classes * 4 + batch * 8 + 4
    none, full = (m.peak_bytes for m in meters.values())
    assert full == none - done_with


def selective_against_plain() -> ActivationMeter:
    """One step of a ConvNet and of its selectively checkpointed copy, measured: the same gradients."""
    torch.manual_seed(0)
    a = convnet(num_classes=10, input_shape=[1, 28, 28])
    b = copy.deepcopy(a)
    ac.apply(b, ActivationCheckpointing.selective, meter=(meter := ActivationMeter()))
    x, y = torch.randn(4, 1, 28, 28), torch.randint(0, 10, (4,))
    nn.functional.cross_entropy(a(x), y).backward()
    one_step(b, x, y, meter)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    return meter


def test_measuring_changes_nothing():
    assert selective_against_plain().peak_bytes


# The simulated torch has no switch, so the real one warns that it was not given: expected here.
@pytest.mark.filterwarnings("ignore:A saved_tensors_hooks context:FutureWarning")
def test_selective_checkpointing_runs_on_a_torch_without_the_saved_tensor_hooks_switch(monkeypatch):
    """torch 2.11's checkpoint has no respect_saved_tensors_hooks and passes unknown keywords on to
    the block's forward: the same gradients there too (seen on the lent H100's torch 2.11)."""
    real = ac.checkpoint

    def checkpoint_2_11(function, *args, use_reentrant=None, context_fn=None, early_stop=True, **kwargs):  # type: ignore[no-untyped-def]
        def forward(*inputs):  # type: ignore[no-untyped-def]
            return function(*inputs, **kwargs)  # what it does not know goes to the function

        return real(forward, *args, use_reentrant=use_reentrant, context_fn=context_fn, early_stop=early_stop)

    monkeypatch.setattr(ac, "checkpoint", checkpoint_2_11)
    monkeypatch.setattr(ac, "_RESPECT_HOOKS", ac.hook_options(checkpoint_2_11))
    selective_against_plain()


def test_a_model_without_blocks_is_refused_before_anything_starts(tmp_path: Path):
    result = run_here(
        tmp_path,
        "model._target_=tests.user_models.unsplittable",
        "data=synthetic",
        "trainer.activation_checkpointing=full",
    )
    assert result.returncode == 2, result
    out = result.stdout + result.stderr
    assert "declares no blocks to checkpoint" in out and "trainer.activation_checkpointing=none" in out
    assert not result.run_dirs()


def test_torchtitans_spelling_points_to_the_setting(tmp_path: Path):
    for given in ("ac.mode=full", "activation_checkpoint.mode=full", "+ac.mode=full"):
        result = run_here(tmp_path, given)
        assert result.returncode == 2, result
        assert "use trainer.activation_checkpointing=none|full|selective" in result.stdout + result.stderr


@pytest.fixture(scope="module")
def ac_sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every strategy, without, with full and with selective checkpointing, on the tower (2 ranks)."""

    def make(cwd: Path) -> None:
        result = run_here(
            cwd,
            "-m",
            f"strategy={','.join(STRATEGIES)}",
            "trainer.activation_checkpointing=none,full,selective",
            *TOWER,
            "hydra.sweep.dir=sweep",
        )
        assert result.returncode == 0, result

    return made_once(tmp_path_factory, "activation_checkpointing", make) / "sweep"


def _run(sweep: Path, strategy: str, mode: str) -> Path:
    return sweep / f"strategy={strategy},trainer.activation_checkpointing={mode}"


@pytest.mark.multiproc
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_trains_to_the_same_parameters_with_checkpointing(ac_sweep: Path, strategy: str):
    """Bitwise: checkpointing recomputes the same operations on the same values, and the BatchNorm
    statistics in model.pt are updated once per step as without it."""
    without = weights(_run(ac_sweep, strategy, "none"))
    for mode in ("full", "selective"):
        run = _run(ac_sweep, strategy, mode)
        assert metrics(run)["facts"]["activation_checkpointing"] == mode
        with_it = weights(run)
        assert list(with_it) == list(without)
        for name, value in without.items():
            assert torch.equal(with_it[name], value), (mode, name)


@pytest.mark.multiproc
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_checkpointing_cuts_the_activations_per_rank(ac_sweep: Path, strategy: str):
    """Measured per rank, in bytes: full keeps each block's input and, while a block recomputes, that
    one block's activations, below half of what six blocks hold without it; selective keeps the
    matmul outputs too, so lies between."""
    per_rank = {
        mode: [r["mem/activations_mb"] for r in metrics(_run(ac_sweep, strategy, mode))["memory_per_rank"]]
        for mode in ("none", "full", "selective")
    }
    assert len(per_rank["none"]) == (1 if strategy == "single" else 2)
    for rank, none in enumerate(per_rank["none"]):
        full, selective = per_rank["full"][rank], per_rank["selective"][rank]
        assert full < 0.5 * none, (rank, per_rank)
        assert full < selective < none, (rank, per_rank)
    final = metrics(_run(ac_sweep, strategy, "full"))["final"]
    assert final["mem/activations_mb"] == max(per_rank["full"])  # the report's: the max over ranks


@pytest.mark.multiproc  # torch.compile: slow to start, and it runs compiler workers
def test_checkpointing_composes_with_compile(ac_sweep: Path, tmp_path: Path):
    """Compiled, the partitioner recomputes from the same blocks and policy: the parameters of eager
    training without checkpointing, within float tolerance (compiled kernels round differently), and
    BatchNorm counts each batch once."""
    result = run_here(
        tmp_path,
        "-m",
        "strategy=single",
        "trainer.compile=true",
        "trainer.activation_checkpointing=full,selective",
        *TOWER,
        "hydra.sweep.dir=c",
    )
    assert result.returncode == 0, result
    eager = weights(_run(ac_sweep, "single", "none"))
    for mode in ("full", "selective"):
        compiled = weights(tmp_path / "c" / f"trainer.activation_checkpointing={mode}")
        assert list(compiled) == list(eager)
        for name, value in eager.items():
            torch.testing.assert_close(compiled[name], value, **TOLERANCE, msg=name)


@pytest.mark.parametrize("form", ["gpt2", "llama"])
@pytest.mark.parametrize("mode", [ActivationCheckpointing.full, *SELECTIVE])
def test_the_transformer_checkpoints_its_blocks_with_the_same_gradients_and_fewer_bytes(form, mode):
    """The GPT's blocks (its shard_units) checkpointed: one step's gradients as without it, and fewer
    bytes held for the backward (bytes, measured: not time)."""
    from ddpexp.models.gpt import gpt

    llama = {"norm": "rmsnorm", "pos_embedding": "rope", "mlp": "swiglu", "bias": False, "n_kv_head": 2}
    torch.manual_seed(0)
    plain = gpt(
        vocab_size=256, input_shape=[64], n_layer=4, n_head=4, dim=64, **(llama if form == "llama" else {})
    )
    checkpointed = copy.deepcopy(plain)
    assert ac.apply(checkpointed, mode) == 4
    assert list(checkpointed.state_dict()) == list(plain.state_dict())
    ids = torch.randint(0, 256, (8, 65), generator=torch.Generator().manual_seed(1))
    held = {}
    for name, model in (("plain", plain), ("checkpointed", checkpointed)):
        meter = ActivationMeter()
        with meter.measure(model):
            logits = model(ids[:, :-1])
            nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
        held[name] = meter.peak_bytes
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7, msg=name)
    bound = 0.5 if mode == ActivationCheckpointing.full else 0.9
    assert held["checkpointed"] < bound * held["plain"], held


@pytest.mark.parametrize("form", ["gpt2", "llama"])
def test_selective_half_keeps_every_second_matmul_of_what_selective_keeps(form):
    """torchtitan's op policy: of a block's matrix products the first, third... are kept, the others
    recomputed: the saved bytes fall from selective's by about those products' outputs, and the
    gradients are unchanged."""
    from ddpexp.models.gpt import gpt

    llama = {"norm": "rmsnorm", "pos_embedding": "rope", "mlp": "swiglu", "bias": False, "n_kv_head": 2}
    ids = torch.randint(0, 256, (8, 65), generator=torch.Generator().manual_seed(1))
    held, grads = {}, {}
    for mode in (ActivationCheckpointing.none, *SELECTIVE):
        torch.manual_seed(0)
        model = gpt(
            vocab_size=256,
            input_shape=[64],
            n_layer=2,
            n_head=4,
            dim=64,
            **(llama if form == "llama" else {}),
        )
        ac.apply(model, mode)
        meter = ActivationMeter()
        with meter.measure(model):
            logits = model(ids[:, :-1])
            nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
        held[mode] = meter.peak_bytes
        grads[mode] = [p.grad.clone() for p in model.parameters()]
    assert (
        held[ActivationCheckpointing.selective_half] < held[ActivationCheckpointing.selective] < held["none"]
    )
    for a, b in zip(grads["none"], grads[ActivationCheckpointing.selective_half], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
