"""What one CUDA GPU measures against what ddpexp predicts: for each case (a transformer under
`strategy=single`, trained for two epochs of synthetic tokens) the last epoch's step time, tokens/s and
model FLOPs utilisation, and per category the predicted (ddpexp.predict.memory, from the run's
config.yaml alone) and measured MB, with CUDA's peak allocated against the predicted peak. The measured
MFU is what a cluster profile's `achieved_mfu` should say; the peak is what `ddpexp plan`'s "fits"
rests on.

    python scripts/on_gpu.py                      # every case (about 5 minutes on one H100)
    python scripts/on_gpu.py --only gpt2          # the cases whose label contains one of these
    python scripts/on_gpu.py --skip compile       # all but those
    python scripts/on_gpu.py --device cpu --only gpt_small --steps 2   # the same path on a CPU

Prints one table; --json FILE keeps every number with the device's name, torch and CUDA versions.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import memory_vs_measured  # beside this script
import torch

from ddpexp.predict import MeasuredRun
from ddpexp.predict.memory import MB, predict_run
from ddpexp.runrecord import read_run_record

CATEGORIES = memory_vs_measured.CATEGORIES
LM = ["data=synthetic_tokens", "task=lm", "optim=adamw", "strategy=single"]
GPT2 = [*LM, "model=gpt2_124m", "trainer.batch_size=8"]
CASES: list[tuple[str, list[str]]] = [
    ("gpt_small fp32 b16x128", [*LM, "model=gpt_small", "trainer.batch_size=16"]),
    ("gpt_small bf16 b64x128", [*LM, "model=gpt_small", "trainer.batch_size=64", "trainer.precision=bf16"]),
    ("gpt2_124m fp32 b8x1024", GPT2),
    ("gpt2_124m bf16 b8x1024", [*GPT2, "trainer.precision=bf16"]),
    (
        "gpt2_124m bf16 b8x1024 ac=full",
        [*GPT2, "trainer.precision=bf16", "trainer.activation_checkpointing=full"],
    ),
    (
        "gpt2_124m bf16 b8x1024 ac=selective",
        [*GPT2, "trainer.precision=bf16", "trainer.activation_checkpointing=selective"],
    ),
    ("gpt2_124m bf16 b32x1024", [*LM, "model=gpt2_124m", "trainer.batch_size=32", "trainer.precision=bf16"]),
    (
        "llama3_2_1b bf16 b4x2048",
        [*LM, "model=llama3_2_1b", "model.block_size=2048", "trainer.batch_size=4", "trainer.precision=bf16"],
    ),
    ("gpt2_124m bf16 b8x1024 compile", [*GPT2, "trainer.precision=bf16", "trainer.compile=true"]),
]


def measure(out: Path, label: str, overrides: list[str], device: str, steps: int | None) -> Path:
    common = [
        f"device={device}",
        "trainer.epochs=2",
        "trainer.progress=false",
        "checkpoint.every_epochs=null",
        *([f"trainer.max_steps={steps}"] if steps else []),
    ]
    return memory_vs_measured.measure(out, label, overrides, common)


def compare(label: str, run_dir: Path, took_s: float) -> dict[str, Any]:
    record = read_run_record(run_dir)
    assert record is not None
    last = record.history[-1] if record.history else record.final
    (predicted,) = predict_run(MeasuredRun.of_record(record))
    (measured,) = record.memory_per_rank
    guess = predicted.mb()
    return {
        "case": label,
        "wall_s": round(took_s, 1),
        "step_s": last.get("perf/step_time_s"),
        "tokens_per_s": last.get("perf/tokens_per_s"),
        "mfu": last.get("perf/mfu"),
        "peak_mb": {"predicted": predicted.peak / MB, "measured": record.final.get("mem/peak_mb")},
        "predicted_transient_mb": predicted.transient / MB,
        **{key: {"predicted": guess[key], "measured": measured.get(key)} for key in CATEGORIES},
        "eval_loss": record.final.get("eval/loss"),
    }


def error(cell: dict[str, Any]) -> str:
    got, guess = cell["measured"], cell["predicted"]
    if not got:
        return "-"
    return f"{guess:,.0f}/{got:,.0f} ({(guess - got) / got:+.0%})"


def table(rows: list[dict[str, Any]]) -> str:
    head = [
        "case",
        "step ms",
        "tokens/s",
        "MFU",
        "peak",
        "params",
        "grads",
        "optimizer",
        "activations",
        "host",
    ]
    lines = [head]
    for r in rows:
        if "failed" in r:
            lines.append([r["case"], "failed: " + r["failed"][:60], *[""] * (len(head) - 2)])
            continue
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        lines.append(
            [
                r["case"],
                f"{r['step_s'] * 1e3:.1f}",
                f"{r['tokens_per_s']:,.0f}",
                mfu,
                error(r["peak_mb"]),
                *(error(r[k]) for k in CATEGORIES),
            ]
        )
    widths = [max(len(x) for x in col) for col in zip(*lines, strict=True)]
    return "\n".join("  ".join(x.ljust(w) for x, w in zip(line, widths, strict=True)) for line in lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("outputs") / f"gpu-{time.strftime('%Y%m%d-%H%M%S')}")
    p.add_argument("--only", help="comma-separated parts of case labels to run")
    p.add_argument("--skip", help="comma-separated parts of case labels not to run")
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, help="trainer.max_steps (a quick check of the path)")
    p.add_argument("--json", type=Path, help="write every number here")
    args = p.parse_args()
    wanted = args.only.split(",") if args.only else None
    unwanted = args.skip.split(",") if args.skip else []
    about = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": time.strftime("%Y-%m-%d"),
    }
    print(about, flush=True)
    rows = []
    for label, overrides in CASES:
        if (wanted and not any(w in label for w in wanted)) or any(w in label for w in unwanted):
            continue
        start = time.perf_counter()
        try:
            run_dir = measure(args.out, label, overrides, args.device, args.steps)
            rows.append(compare(label, run_dir, time.perf_counter() - start))
        except Exception as e:  # one case failing must not cost the others' numbers
            rows.append({"case": label, "failed": f"{type(e).__name__}: {e}"})
        print(json.dumps(rows[-1]), flush=True)
        if args.json:
            args.json.write_text(json.dumps({"about": about, "rows": rows}, indent=1))
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
