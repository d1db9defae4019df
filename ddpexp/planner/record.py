"""The published record as a test set: runs others measured on hardware ddpexp has not (torchtitan's and
MosaicML's H100 and A100 tables, Megatron-LM's scaling table), each with its source, its hardware as a
cluster profile, its configuration as ddpexp's overrides, what was published and what ddpexp predicts
for it from the config alone (`ddpexp plan` with the layout given: one row).

published_record.yaml (beside this module) holds the rows and the last predictions
(scripts/published_record.py --update writes them); docs/published_record.md is its table;
tests/test_published_record.py recomputes the predictions and checks the targets on the rows no
constant was fitted to (held out). Rows the model cannot express yet (async tensor parallelism,
checkpointing every second block) carry what is missing instead of a prediction.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RECORD = Path(__file__).with_name("published_record.yaml")

# The constants of the per-op model fitted to rows of the record (conf/devices), each to make its row's
# predicted tokens/s equal to the published one, in this order (scripts/published_record.py --fit):
# those rows are in-sample, every other row held out. Host time per kernel is not fitted: each
# device's profile gives what its host was measured to take, or an assumption.
FITTED: dict[str, list[tuple[str, str]]] = {
    "h100_sxm": [
        ("launch_us", "ddpexp-gpt_small-fp32-16x128"),
        ("matmul_efficiency.fp32", "ddpexp-gpt2_124m-fp32-8x1024"),
        ("matmul_efficiency.bf16", "mosaicml-mpt7b-2048-8xh100"),
    ],
    "a100_sxm_80gb": [("matmul_efficiency.bf16", "mosaicml-mpt7b-2048-8xa100")],
    "h100_96gb_500w": [
        ("matmul_efficiency.bf16", "torchtitan-8b-8gpu-fsdp"),
        ("matmul_efficiency.fp8", "torchtitan-8b-8gpu-fsdp-compile-float8"),
        ("ring_efficiency", "torchtitan-8b-8gpu-fsdp1-cp8"),
    ],
}


@dataclass(frozen=True)
class Prediction:
    tokens_per_s_per_device: float
    peak_gib: float
    fits: bool
    step_s: float
    mfu: float
    label: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "tokens_per_s_per_device": round(self.tokens_per_s_per_device, 1),
            "peak_gib": round(self.peak_gib, 4),
            "fits": self.fits,
            "step_s": round(self.step_s, 4),
            "mfu": round(self.mfu, 4),
        }


@dataclass(frozen=True)
class Row:
    id: str
    source: str  # URL
    table: str  # where in the source
    hardware: str
    cluster: str  # conf/cluster profile
    nodes: int
    overrides: tuple[str, ...]
    seq_len: int
    published_tokens_per_s: float  # per device
    published_gib: float | None = None
    memory_kind: str | None = None  # what the source's memory is: reserved, allocated
    in_sample: bool = False  # a constant of the model was fitted to it
    missing: str | None = None  # what ddpexp cannot express yet
    note: str | None = None
    predicted: Prediction | None = None
    setting: str | None = None  # rows of one published setting (model, cluster, batch) share it

    @property
    def held_out(self) -> bool:
        return not self.in_sample and self.missing is None

    def error(self) -> float | None:
        """Predicted over published tokens/s per device, less one."""
        if self.predicted is None:
            return None
        return self.predicted.tokens_per_s_per_device / self.published_tokens_per_s - 1

    def memory_error(self) -> float | None:
        if self.predicted is None or self.published_gib is None:
            return None
        return self.predicted.peak_gib / self.published_gib - 1


@dataclass(frozen=True)
class Recommendation:
    """For one published setting: the plan `ddpexp plan` recommends when it searches, and how that
    compares with the published layout's predicted throughput."""

    setting: str
    recommended: str
    recommended_tokens_per_s: float
    published_row: str
    published_tokens_per_s: float  # the published layout's, as ddpexp predicts it

    @property
    def within(self) -> float:
        """The published layout's predicted throughput over the recommendation's, less one."""
        return self.published_tokens_per_s / self.recommended_tokens_per_s - 1


@dataclass
class Record:
    rows: list[Row]
    recommendations: list[Recommendation] = field(default_factory=list)
    date: str = ""
    machine: str = ""

    def errors(self, *, held_out: bool) -> list[float]:
        rows = [r for r in self.rows if r.predicted is not None and (r.held_out or not held_out)]
        return [abs(e) for r in rows if (e := r.error()) is not None]

    def summary(self) -> dict[str, Any]:
        held, every = self.errors(held_out=True), self.errors(held_out=False)
        runnable = [r for r in self.rows if r.predicted is not None]
        memory = [abs(e) for r in runnable if (e := r.memory_error()) is not None]
        return {
            "held_out_rows": len(held),
            "held_out_median_error": statistics.median(held) if held else None,
            "held_out_worst_error": max(held) if held else None,
            "all_rows": len(every),
            "all_median_error": statistics.median(every) if every else None,
            "all_worst_error": max(every) if every else None,
            "predicted_to_fit": sum(r.predicted.fits for r in runnable if r.predicted is not None),
            "runnable_rows": len(runnable),
            "memory_rows": len(memory),
            "memory_worst_error": max(memory) if memory else None,
            "missing_rows": sum(r.missing is not None for r in self.rows),
        }


def load(path: Path = RECORD) -> Record:
    import yaml

    raw = yaml.safe_load(path.read_text())
    rows = []
    for item in raw["rows"]:
        item = dict(item)
        predicted = item.pop("predicted", None)
        published = item.pop("published")
        rows.append(
            Row(
                **{k: v for k, v in item.items() if k != "overrides"},
                overrides=tuple(item["overrides"]),
                published_tokens_per_s=float(published["tokens_per_s_per_device"]),
                published_gib=published.get("memory_gib"),
                memory_kind=published.get("memory_kind"),
                predicted=None if predicted is None else Prediction(**predicted),
            )
        )
    recommendations = [Recommendation(**r) for r in raw.get("recommendations") or []]
    return Record(rows, recommendations, str(raw.get("date", "")), str(raw.get("machine", "")))


def predict(row: Row, *, device: Any = None, cache: dict[Any, Any] | None = None) -> Prediction | None:
    """What `ddpexp plan` predicts for the row's layout on its cluster (None: it cannot express it).
    `device`: a device profile instead of the cluster's (fitting a constant); `cache`: fake runs to
    reuse across calls."""
    if row.missing is not None:
        return None
    import dataclasses

    from ..predict.interconnect import fabric
    from .estimate import composed, job_of
    from .profiles import load_cluster
    from .search import search

    cluster = load_cluster(row.cluster, nodes=row.nodes)
    if device is not None:
        cluster = dataclasses.replace(cluster, hardware=device)
    overrides, cfg = composed(list(row.overrides), row.seq_len)
    job = job_of(overrides, cfg, tokens=None, epochs=None)
    (result,) = search(job, cluster, fabric(cluster.interconnect), cache=cache)
    if result.note is not None:
        raise ValueError(f"{row.id}: {result.note}")
    return Prediction(
        result.tokens_per_s_per_device,
        result.peak_bytes / 2**30,
        result.fits,
        result.step_s,
        result.mfu,
        result.label,
    )


def recommend(rows: list[Row]) -> Recommendation:
    """For one published setting (its rows share model, cluster, batch and sequence): the layout the
    search recommends, among those with torch.compile as the published runs had it (a switch, not a
    layout), against the fastest published layout as ddpexp predicts it."""
    from ..predict.interconnect import fabric
    from .estimate import composed, job_of
    from .profiles import load_cluster
    from .search import search

    predicted = [(r, r.predicted) for r in rows if r.predicted is not None]
    published, prediction = max(predicted, key=lambda pair: pair[1].tokens_per_s_per_device)
    compiled = "trainer.compile=true" in published.overrides
    cluster = load_cluster(published.cluster, nodes=published.nodes)
    layout = ("strategy", "trainer.activation_checkpointing", "trainer.accumulate", "trainer.compile")
    setting = [o for o in published.overrides if not o.split("=", 1)[0].startswith(layout)]
    overrides, cfg = composed(setting, published.seq_len)
    job = job_of(overrides, cfg, tokens=None, epochs=None)
    tried = search(job, cluster, fabric(cluster.interconnect), everything=True)
    fitting = [r for r in tried if r.note is None and r.fits and r.candidate.settings.compile == compiled]
    best = max(fitting, key=lambda r: r.tokens_per_s)
    return Recommendation(
        published.setting or published.id,
        best.label,
        best.tokens_per_s_per_device,
        published.id,
        prediction.tokens_per_s_per_device,
    )
