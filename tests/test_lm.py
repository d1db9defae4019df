"""Language modelling as a user meets it: `task=lm` on a token corpus (the Python standard library's
own files, random tokens, or text files of one's own), exact token metrics over any number of ranks,
tokens/s and MFU in every place a run's numbers go, and one-line refusals for corpora that cannot be
trained on. The models here are tiny stand-ins that read token ids (ddpexp's GPT is tested apart)."""

from __future__ import annotations

import json
import math
import platform
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ddpexp import flops, tasks
from ddpexp.config import BestMode, Precision
from ddpexp.data import loaders
from ddpexp.data.python_stdlib import python_stdlib
from ddpexp.data.text_files import text_files
from ddpexp.data.tokens import file_key, synthetic_tokens, windows

from .conftest import metrics, run_here, scalars
from .test_cli import refuse
from .test_report import fabricate, md_tables, run_report


class TinyLM(nn.Module):
    """Embedding -> tanh -> linear: next-token logits from the current token alone."""

    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(ids)))

    def flops_per_token(self, seq_len: int) -> float:
        return 6.0 * sum(p.numel() for p in self.parameters())


def tiny_lm(
    *, vocab_size: int, input_shape: list[int], block_size: int | None = None, dim: int = 32
) -> nn.Module:
    """block_size, where given, is what the data's block_size defaults to (conf/data/*.yaml)."""
    assert block_size is None or input_shape == [block_size]
    return TinyLM(vocab_size, dim)


def bigram_lm(*, vocab_size: int, input_shape: list[int]) -> nn.Module:
    """A table of logits per token: each position's outputs are one row, whatever the batch holds, so
    the eval loss over any sharding is the same float sum."""
    return nn.Embedding(vocab_size, vocab_size)


class WordTokenizer:
    """The tokenizer contract (data.tokenizer): vocab_size, called on a file's text; eos_id optional."""

    WORDS = ("<unk>", "<eos>", "the", "cat", "sat", "on", "mat", "a", "dog", "ran")
    vocab_size = len(WORDS)
    eos_id = 1

    def __call__(self, text: str) -> list[int]:
        return [self.WORDS.index(w) if w in self.WORDS else 0 for w in text.split()]


class NotATokenizer:
    pass


class WildTokenizer(WordTokenizer):
    vocab_size = 3  # gives ids up to 9


LM = ["task=lm", "model._target_=tests.test_lm.tiny_lm", "trainer.progress=false"]


# ---- windows, and the task's sums ----


def test_samples_are_block_plus_one_windows_viewed_from_one_compact_tensor():
    tokens = torch.arange(23, dtype=torch.uint8)
    split = windows(tokens, 5)
    x, y = split.tensors
    assert x.tolist() == [list(range(i, i + 5)) for i in (0, 5, 10, 15)]  # (23 - 1) // 5 = 4 windows
    assert y.tolist() == [list(range(i + 1, i + 6)) for i in (0, 5, 10, 15)]
    # 1 byte a token: both are views of the corpus, no copy
    assert x.dtype == y.dtype == torch.uint8
    assert (
        x.untyped_storage().data_ptr()
        == y.untyped_storage().data_ptr()
        == tokens.untyped_storage().data_ptr()
    )
    # batches reach the model and the loss as int64, on both loader paths, the same batches
    seen = {}
    for mode in ("device", "dataloader"):
        loader = loaders.build(
            split, mode=mode, batch_size=2, rank=0, world=1, seed=0, device=torch.device("cpu"), train=True
        )
        loader.set_epoch(0)
        seen[mode] = list(loader)
        assert all(i.dtype == t.dtype == torch.long for i, t in seen[mode])
    assert all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(*seen.values(), strict=True)
    )


def test_the_lm_task_counts_tokens_not_samples_and_ppl_is_exp_of_the_mean_loss():
    torch.manual_seed(0)
    outputs, targets = torch.randn(5, 7, 11), torch.randint(11, (5, 7))
    task = tasks.LanguageModel()
    whole = task.finish(task.eval_sums(outputs, targets).tolist())
    parts = task.eval_sums(outputs[:2], targets[:2]) + task.eval_sums(outputs[2:], targets[2:])
    split = task.finish(parts.tolist())
    per_token = F.cross_entropy(outputs.reshape(-1, 11).double(), targets.reshape(-1), reduction="none")
    for values in (whole, split):
        assert values["eval/loss"] == pytest.approx(per_token.mean().item(), rel=1e-6)
        assert values["eval/ppl"] == pytest.approx(math.exp(values["eval/loss"]), rel=1e-12)
        assert values["eval/token_acc"] == (outputs.argmax(-1) == targets).double().mean().item()
        assert (values["eval/tokens"], values["eval/samples"]) == (35, 5)
    assert task.loss(outputs, targets).item() == pytest.approx(per_token.mean().item(), rel=1e-5)
    assert (tasks.LanguageModel.best_metric, tasks.LanguageModel.best_mode) == ("eval/loss", BestMode.min)


# ---- exact over ranks ----

EXACT = [
    "task=lm",
    "model._target_=tests.test_lm.bigram_lm",
    "data=synthetic_tokens",
    "data.block_size=16",
    f"data.train_tokens={16 * 24 + 1}",
    f"data.eval_tokens={16 * 37 + 1}",  # 37 windows: 19 + 18 on 2 ranks, 13 + 12 + 12 on 3
    "trainer.batch_size=12",
    "trainer.eval_batch_size=12",
    "trainer.max_steps=0",  # score the initial weights, which every rank shares
    "trainer.progress=false",
]


@pytest.mark.multiproc
def test_eval_metrics_are_exact_over_one_two_and_three_ranks(tmp_path: Path):
    runs = {
        1: ["strategy=single"],
        2: ["strategy=ddp", "dist.nprocs=2"],
        3: ["strategy=ddp", "dist.nprocs=3"],
    }
    for world, args in runs.items():
        result = run_here(tmp_path, *EXACT, *args, f"hydra.run.dir=w{world}")
        assert result.returncode == 0, result
    # the reference: every eval window scored by hand, each token's loss summed in float64
    table = torch.load(tmp_path / "w1" / "model.pt", weights_only=True)["weight"]
    splits = synthetic_tokens(block_size=16, train_tokens=16 * 24 + 1, eval_tokens=16 * 37 + 1).load(tmp_path)
    x, y = (t.long() for t in splits.eval.tensors)
    logits = table[x]
    loss = F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1), reduction="none").double().mean().item()
    acc = (logits.argmax(-1) == y).double().mean().item()
    for world in runs:
        final = metrics(tmp_path / f"w{world}")["final"]
        assert metrics(tmp_path / f"w{world}")["facts"]["world_size"] == world
        assert (final["eval/samples"], final["eval/tokens"]) == (37, 37 * 16)
        assert final["eval/loss"] == pytest.approx(loss, rel=1e-12, abs=0)
        assert final["eval/ppl"] == pytest.approx(math.exp(loss), rel=1e-12, abs=0)
        assert final["eval/token_acc"] == pytest.approx(acc, rel=1e-12, abs=0)


# ---- the standard library corpus ----


def _fake_stdlib(root: Path, extra: int = 0) -> Path:
    for i in range(40 + extra):
        (root / f"pkg{i % 3}").mkdir(parents=True, exist_ok=True)
        (root / f"pkg{i % 3}" / f"mod{i}.py").write_text(f"x = {i}\n" * (5 + 7 * i))
    for left_out in (
        "test/test_a.py",
        "site-packages/lib.py",
        "config-3.11-x86_64/conf.py",
        "_sysconfigdata_x.py",
    ):
        (root / left_out).parent.mkdir(parents=True, exist_ok=True)
        (root / left_out).write_text("left out\n")
    return root


def test_the_stdlib_corpus_is_split_by_file_the_same_way_every_time(tmp_path: Path):
    root = _fake_stdlib(tmp_path / "lib")
    source = python_stdlib(root=str(root), max_bytes=None, block_size=8)
    train, held = ([n for n, _ in s] for s in source.selection)
    assert not set(train) & set(held) and len(train) + len(held) == 40  # the left-out folders are out
    assert all(file_key(n)[0] < 0.1 for n in held) and all(file_key(n)[0] >= 0.1 for n in train)
    assert held and train
    # a file's split depends on its own path only: more files (another Python) move none of these
    _fake_stdlib(root, extra=20)
    again = python_stdlib(root=str(root), max_bytes=None, block_size=8).selection
    assert set(held) <= {n for n, _ in again[1]} and set(train) <= {n for n, _ in again[0]}
    # a size cap keeps a part fixed by the paths, within its bytes, eval_fraction of them for eval
    capped = python_stdlib(root=str(root), max_bytes=20_000, block_size=8)
    sizes = [sum(s for _, s in part) for part in capped.selection]
    assert sizes[0] <= 18_000 and sizes[1] <= 2_000 and sizes[0] > 15_000
    assert capped.selection == python_stdlib(root=str(root), max_bytes=20_000, block_size=8).selection


def test_the_stdlib_corpus_records_what_it_read(tmp_path: Path):
    root = _fake_stdlib(tmp_path / "lib")
    source = python_stdlib(root=str(root), max_bytes=None, block_size=8)
    splits = source.load(tmp_path)
    facts = splits.facts
    train, held = source.selection
    assert facts["python"] == platform.python_version()
    assert facts["files"] == {"train": len(train), "eval": len(held)}
    assert facts["bytes"]["train"] == sum(s for _, s in train)
    assert facts["train_tokens"] == facts["bytes"]["train"] + len(train)  # a NUL ends every file
    assert splits.info.train_samples == len(splits.train.dataset) == (facts["train_tokens"] - 1) // 8
    # an edit of one byte changes the fingerprint, not the file list
    first = root / train[0][0]
    first.write_text(first.read_text().replace("x", "y", 1))
    edited = python_stdlib(root=str(root), max_bytes=None, block_size=8).load(tmp_path)
    assert edited.facts["file_list_sha256"] == facts["file_list_sha256"]
    assert edited.fingerprint != splits.fingerprint


def test_this_pythons_own_stdlib_is_a_corpus_of_its_default_size():
    source = python_stdlib()
    source.check()
    info = source.info()
    train, held = source.selection
    assert (info.vocab_size, info.input_shape, info.targets, info.tokens_per_sample) == (
        256,
        (128,),
        "token",
        128,
    )
    assert 900_000 - 50_000 < sum(s for _, s in train) <= 900_000 and 0 < sum(s for _, s in held) <= 100_000
    assert not [
        n for n, _ in train + held if n.split("/")[0] in ("test", "idlelib", "tkinter", "site-packages")
    ]


# ---- a run, end to end ----


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    cwd = tmp_path_factory.mktemp("lm")
    args = [
        *LM,
        "data=python_stdlib",
        "data.max_bytes=200000",
        "+model.block_size=32",  # the data's block_size follows the model's
        "optim=adamw",
        "optim.lr=0.01",
        "trainer.epochs=1",
        "trainer.max_steps=60",
        "trainer.eval_every_steps=20",
        "trainer.peak_flops=1e11",
        "hydra.run.dir=lm",
    ]
    result = run_here(cwd, *args)
    assert result.returncode == 0, result
    return cwd / "lm", result.stdout


def test_a_language_model_trains_on_the_stdlib_and_its_eval_loss_falls(lm_run: tuple[Path, str]):
    run, _ = lm_run
    losses = [v for _, v in scalars(run)["eval/loss"]]
    assert losses[0] > losses[-1] and losses[-1] < math.log(256) - 1.5, losses
    m = metrics(run)
    assert m["facts"]["tokens_per_sample"] == 32 and m["facts"]["best_metric"] == "eval/loss"
    assert m["facts"]["data_facts"]["python"] == platform.python_version()
    assert m["facts"]["data_fingerprint"] and m["best"]["eval/loss"] == pytest.approx(min(losses), rel=1e-6)
    assert m["final"]["eval/ppl"] == pytest.approx(math.exp(m["final"]["eval/loss"]))


def test_tokens_per_second_and_mfu_are_recorded_everywhere(lm_run: tuple[Path, str], tmp_path: Path):
    run, stdout = lm_run
    m = metrics(run)
    final, facts = m["final"], m["facts"]
    assert final["perf/tokens_per_s"] == pytest.approx(32 * final["perf/samples_per_s"])
    assert facts["flops_per_token"] == 6.0 * facts["parameters"]
    assert (facts["peak_flops"], facts["peak_flops_source"]) == (1e11, "trainer.peak_flops")
    assert final["perf/mfu"] == pytest.approx(facts["flops_per_token"] * final["perf/tokens_per_s"] / 1e11)
    line = next(line for line in stdout.splitlines() if line.startswith("epoch 1/1"))
    assert (
        f"{final['perf/tokens_per_s']:,.0f} tokens/s" in line
        and f"MFU {100 * final['perf/mfu']:.2f}%" in line
    )
    assert "eval_token_acc" in line and "%" in line.split("eval_token_acc")[1].split()[0]
    logged = scalars(run)
    assert {"perf/tokens_per_s", "perf/mfu", "eval/ppl", "eval/token_acc"} <= logged.keys()
    assert logged["eval/token_acc"][-1][1] == pytest.approx(100 * final["eval/token_acc"], rel=1e-5)  # in %
    assert "eval/tokens" not in logged  # constant over a run: run/constants
    _assert_hparams_show(run, ["perf/tokens_per_s", "perf/mfu", "eval/loss"])
    # the report: tokens/s and MFU columns, and in its records
    out = run_report(str(run), "--out", str(tmp_path))
    row = md_tables((tmp_path / "report.md").read_text())["lm"]
    assert (
        row["tokens/s"] == f"{final['perf/tokens_per_s']:,.0f}"
        and row["MFU"] == f"{100 * final['perf/mfu']:.2f}%"
    )
    assert "tokens/s" in out
    run_report(str(run), "--out", str(tmp_path), "--format", "json")
    (record,) = json.loads((tmp_path / "report.json").read_text())
    assert record["tokens_per_s_median"] == pytest.approx(final["perf/tokens_per_s"])
    assert record["mfu"] == pytest.approx(final["perf/mfu"])


def _assert_hparams_show(run: Path, tags: list[str]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata

    acc = EventAccumulator(str(run), size_guidance={"tensors": 0})
    acc.Reload()
    content = acc.PluginTagToContent("hparams")
    experiment = metadata.parse_experiment_plugin_data(content[metadata.EXPERIMENT_TAG])
    assert set(tags) <= {m.name.tag for m in experiment.metric_infos}


def test_a_classification_report_has_no_token_columns_and_different_corpora_are_flagged(tmp_path: Path):
    fabricate(tmp_path / "images", "a")
    out = run_report(str(tmp_path / "images"))
    assert "tokens/s" not in (tmp_path / "images" / "report.md").read_text() and "different data" not in out
    lm = {"data": "python_stdlib", "tokens_per_sample": 128, "best_metric": "eval/loss", "best_mode": "min"}
    fabricate(tmp_path / "lm", "py311", data_fingerprint="aa", data_facts={"python": "3.11.7"}, **lm)
    fabricate(tmp_path / "lm", "py312", data_fingerprint="bb", data_facts={"python": "3.12.1"}, **lm)
    out = run_report(str(tmp_path / "lm"))
    assert "the runs read different data (Python 3.11.7, 3.12.1), 2 data fingerprints" in out


# ---- tasks and data that do not fit ----


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (
            ["task=lm", "data=digits"],
            ["task=lm", "class labels", "task=classification", "data=python_stdlib"],
        ),
        (["model=gcnn", "data=synthetic_tokens"], ["task=classification", "token sequences", "task=lm"]),
        (["model=convnet", "data=synthetic_tokens", "task=lm"], ["images", "token ids", "model=gpt_tiny"]),
    ],
)
def test_a_task_or_model_that_does_not_fit_token_data_is_refused(tmp_path, monkeypatch, capsys, args, words):
    line = refuse(tmp_path, monkeypatch, capsys, *args)
    assert all(word in line for word in words), line


# ---- your own text files ----


@pytest.fixture
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("corpus")


def _refused(tmp_path, monkeypatch, capsys, path: str, *more: str) -> str:
    return refuse(tmp_path, monkeypatch, capsys, *LM, "data=text_files", f"data.path={path}", *more)


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("missing", ["data.path", "does not exist", "a folder, a file or a glob"]),
        ("unset", ["data.path", "is not set"]),
        ("no files", ["data.path", "holds no text (no files)"]),
        ("glob of nothing", ["data.path", "holds no text (no files)"]),
        ("empty files", ["data.path", "holds no text (2 empty files)"]),
        ("binary", ["data.path", "blob.bin is not text", "NUL byte", "leave it out"]),
        ("not utf-8", ["data.path", "latin.txt is not text", "not UTF-8 (byte 0xe9 at offset 3)"]),
        (
            "short train",
            ["data.block_size", "the train split of text_files holds 46 tokens", "data.block_size<=45"],
        ),
        (
            "short eval",
            ["data.block_size", "the eval split of text_files holds 40 tokens", "data.block_size<=39"],
        ),
    ],
)
def test_text_files_that_cannot_be_trained_on_are_refused_in_one_line(
    tmp_path, monkeypatch, capsys, corpus: Path, case: str, words: list[str]
):
    path = str(corpus)
    more: list[str] = []
    if case == "missing":
        path = str(corpus / "nowhere")
    elif case == "unset":
        path = "null"
    elif case == "glob of nothing":
        (corpus / "a.txt").write_text("some text\n")
        path = f"'{corpus}/*.md'"
    elif case == "empty files":
        (corpus / "a.txt").write_text("")
        (corpus / "b.txt").write_text("")
    elif case == "binary":
        (corpus / "a.txt").write_text("some text\n" * 50)
        (corpus / "blob.bin").write_bytes(b"\x89PNG\r\n\x1a\n\0\0")
    elif case == "not utf-8":
        (corpus / "latin.txt").write_bytes("café".encode("latin-1"))
    elif case == "short train":
        (corpus / "a.txt").write_text("x" * 50)
    elif case == "short eval":  # one file: its last tenth is eval
        (corpus / "a.txt").write_text("x" * 399)
        more = ["data.block_size=64"]
    line = _refused(tmp_path, monkeypatch, capsys, path, *more)
    assert all(word in line for word in words), line


def test_text_files_read_a_folder_a_file_or_a_glob_byte_level(corpus: Path):
    for i in range(12):
        (corpus / "sub").mkdir(exist_ok=True)
        (corpus / "sub" / f"t{i}.txt").write_text(f"text number {i}\n" * 20)
    (corpus / ".hidden").write_text("not read\n")
    (corpus / "notes.md").write_text("# notes\n" * 40)
    folder, one, glob = (
        text_files(path=p, block_size=16)
        for p in (str(corpus), str(corpus / "notes.md"), f"{corpus}/sub/*.txt")
    )
    assert len(folder.files[1]) == 13 and len(glob.files[1]) == 12 and one.files[1] == [corpus / "notes.md"]
    for source in (folder, one, glob):
        source.check()
        splits = source.load(corpus)
        train, held = source.splits()
        assert splits.info.vocab_size == 256 and splits.info.train_samples == len(splits.train.dataset)
        if len(train) > 1:
            assert held and not set(train) & set(held)
    # one file: its last tenth is eval, the rest train
    x, _ = windows(torch.frombuffer(bytearray(b"# notes\n" * 40 + b"\0"), dtype=torch.uint8), 16).tensors
    splits = one.load(corpus)
    assert torch.equal(splits.train.tensors[0][0], x[0])


def test_a_tokenizer_of_your_own_sets_the_vocabulary(corpus: Path, tmp_path: Path):
    (corpus / "a.txt").write_text("the cat sat on the mat\n" * 40)
    (corpus / "b.txt").write_text("a dog ran\n" * 40)
    args = [*LM, "data=text_files", f"data.path={corpus}", "data.block_size=8"]
    tokenizer = "+data.tokenizer._target_=tests.test_lm.WordTokenizer"
    result = run_here(
        tmp_path, *args, tokenizer, "trainer.max_steps=2", "trainer.batch_size=4", "hydra.run.dir=run"
    )
    assert result.returncode == 0, result
    m = metrics(tmp_path / "run")
    assert m["facts"]["vocab_size"] == 10 and m["facts"]["data_facts"]["tokenizer"] == "WordTokenizer"
    assert torch.load(tmp_path / "run" / "model.pt", weights_only=True)["embed.weight"].shape == (10, 32)
    # the tokens: the tokenizer's ids, its eos_id after each file
    source = text_files(path=str(corpus), block_size=8, tokenizer=WordTokenizer())
    train, held = source.tokens()
    words = {"a.txt": [2, 3, 4, 5, 2, 6] * 40 + [1], "b.txt": [7, 8, 9] * 40 + [1]}
    train_files, eval_files = source.splits()
    assert train.tolist() == [i for p in train_files for i in words[p.name]]
    assert held.tolist() == [i for p in eval_files for i in words[p.name]]


@pytest.mark.parametrize(
    ("tokenizer", "words"),
    [
        ("NotATokenizer", ["data.tokenizer", "NotATokenizer is not a tokenizer", "vocab_size"]),
        ("WildTokenizer", ["data.tokenizer", "gave id", "outside its vocab_size 3"]),
    ],
)
def test_a_tokenizer_that_breaks_the_contract_is_refused(
    tmp_path, monkeypatch, capsys, corpus, tokenizer, words
):
    (corpus / "a.txt").write_text("the cat sat on the mat\n" * 40)
    target = f"+data.tokenizer._target_=tests.test_lm.{tokenizer}"
    line = _refused(tmp_path, monkeypatch, capsys, str(corpus), target, "data.block_size=8")
    assert all(word in line for word in words), line


# ---- peak FLOPs ----


@pytest.mark.parametrize(
    ("name", "kind", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.5),
        ("NVIDIA H100 80GB HBM3", "tf32", 494.5),
        ("NVIDIA H100 PCIe", "bf16", 756.5),
        ("NVIDIA H100 NVL", "fp32", 60),
        ("NVIDIA H200", "bf16", 989.5),
        ("NVIDIA H200 NVL", "bf16", 835.5),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312),
        ("NVIDIA A100 80GB PCIe", "fp32", 19.5),
    ],
)
def test_gpu_peaks_are_the_datasheets_dense_figures(name: str, kind: str, tflops: float):
    assert flops.gpu_peak(name, kind) == pytest.approx(tflops * 1e12)


def test_mfu_needs_a_known_peak_cpus_and_unknown_gpus_have_none(monkeypatch: pytest.MonkeyPatch):
    assert flops.gpu_peak("NVIDIA GeForce RTX 4090", "bf16") is None
    assert flops.peak_flops(None, torch.device("cpu"), Precision.fp32)[0] is None
    assert flops.peak_flops(2e11, torch.device("cpu"), Precision.fp32) == (2e11, "trainer.peak_flops")
    assert flops.matmul_kind(Precision.bf16) == flops.matmul_kind(Precision.fp16) == "bf16"
    # a GPU: its name looked up for the precision its matmuls run in
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    peak, source = flops.peak_flops(None, torch.device("cuda", 0), Precision.bf16)
    assert (peak, source) == (989.5e12, "NVIDIA H100 80GB HBM3, bf16 dense (NVIDIA datasheet)")
    assert flops.peak_flops(None, torch.device("cuda", 0), Precision.fp32)[0] == 67e12
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert flops.matmul_kind(Precision.fp32) == "tf32"
    assert flops.peak_flops(None, torch.device("cuda", 0), Precision.fp32)[0] == 494.5e12
    assert flops.model_flops_per_token(TinyLM(8, 4), 16) == 6.0 * (8 * 4 + 4 * 8 + 8)
    assert flops.model_flops_per_token(nn.Linear(2, 2), 16) is None
