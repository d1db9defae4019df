"""`ddpexp-predict` (`python -m ddpexp.predict`): a cost model that predicts, from one measured run,
the step time and scaling efficiency of the same job on W devices over N nodes, on an interconnect
described by a profile (conf/interconnect/*.yaml) or measured by `ddpexp.commbench`.

    ddpexp-predict RUN_DIR --devices 1,2,4,8,16 --nodes 1,2 --interconnect nvlink4,ib400
    ddpexp-predict RUN_DIR --strategy fsdp --devices 2,3,4 --commbench commbench.json
    ddpexp-predict RUN_DIR --calibrate FSDP_RUN_ON_2 --devices 3,4 --commbench commbench.json

The pieces, in the order a prediction uses them (docs/cost_model.md says what each assumes):

  the run       metrics.json: step time, metered communication time and bytes per step (the epochs
                after the first), facts (strategy, world, batch, device, cores, threads); config.yaml:
                the model, rebuilt on the meta device for its shapes (or one flat tensor of
                facts.parameters where it cannot be rebuilt)
  the strategy  `Strategy.communication` (what it sends per step: `Collective`s, next to the code that
                sends it) and `Strategy.compute_share` (its share of the step's compute)
  the fabric    per operation, a link's latency alpha and seconds per byte beta, intra- and inter-node;
                a collective costs calls x hops(W) x alpha + bus_factor(W) x bytes x beta on its
                slowest link
  the step      compute (the run's, divided as the strategy divides it, slowed where CPU processes
                share cores) + the communication that does not hide behind the forward/backward pass
                (+ with --calibrate, what a run of the strategy itself measured beyond the prediction
                at its own size)

`predict_curve` gives the report (device count, efficiency) points to draw next to the measured ones.

The package, one concern a module:
  interconnect.py   links, fabrics and the ring formulas: profiles (conf/interconnect) and commbench fits
  measured.py       the run: its record (ddpexp.runrecord) and config, `MeasuredRun`
  shapes.py         the run's model rebuilt on the meta device for its shapes (`model_shape`)
  model.py          the predictor: the target strategy, the host's cores, hidden communication,
                    `Predictor`, `predict_curve`, `predicted_bytes`
  render.py         the table and the assumptions a prediction prints
  memory.py         memory per rank by category, from the config alone on fake tensors (`predict`)
  validation.py     the record of the model's held-out validation (scripts/predict_vs_measured.py
                    --record), whose spread `ddpexp plan` puts around its times and costs
  cli.py            the command line (`main`)
"""

from .cli import main
from .measured import MeasuredRun
from .model import Predictor, predict_curve, predicted_bytes

__all__ = ["MeasuredRun", "Predictor", "main", "predict_curve", "predicted_bytes"]
