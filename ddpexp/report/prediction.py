"""`--predict`: each group's predicted scaling curves from the cost model (ddpexp.predict), drawn on
scaling.png next to the measured points."""

from __future__ import annotations

from collections.abc import Callable

from ..runrecord import setting_text
from .groups import Group
from .scaling_plot import Predicted


def prediction(source: str) -> Callable[[Group], Predicted]:
    """Each group's predicted curves (ddpexp.predict): every strategy label of the group, from the
    group's baseline run, at 1 to max(4, the most devices measured) devices. A strategy the model cannot
    predict from that run is left out with a warning on stdout."""
    from ..errors import UserError
    from ..predict.model import predict_curve

    bench = source if source.endswith(".json") else None
    profile = None if bench else source

    def curves(group: Group) -> Predicted:
        if group.baseline is None:
            return {}
        base = group.baseline.runs[0]
        devices = list(range(1, max(4, *(row.devices for row in group.rows)) + 1))
        out: dict[str, list[tuple[int, float]]] = {}
        for row in group.rows:
            if row is group.baseline or row.strategy in out:
                continue
            settings = [
                f"{k}={setting_text(v)}" for k, v in (row.facts.get("strategy_settings") or {}).items()
            ]
            try:
                curve = predict_curve(
                    base.path,
                    devices,
                    interconnect=profile,
                    commbench=bench,
                    strategy=row.facts.get("strategy"),
                    settings=settings,
                )
            except UserError as exc:
                print(f"warning: no prediction for {row.strategy}: {exc}")
                continue
            if any(d > 1 for d, _ in curve):
                out[row.strategy] = curve
            else:  # dp on a CPU host: one replica, whatever the device count
                print(f"note: no prediction for {row.strategy} beyond one device on this host")
        return out

    return curves
