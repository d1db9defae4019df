"""`ddpexp plan`: which strategy, mesh and settings to use for a model on a cluster you are about to
rent, and what each costs, before anything runs.

    ddpexp plan model=llama3_1_8b trainer.batch_size=64 trainer.precision=bf16 optim=adamw \
        --cluster 8xh100_sxm --tokens 1e9

For every mesh (the data-parallel strategies, nd's meshes of tensor parallelism, pipeline stages and
FSDP, HSDP over nodes, pipeline with replicas), the settings practitioners tune (the micro-batch with
gradient accumulation, activation checkpointing, torch.compile, FSDP's resharding and gather dtype),
each estimated:

  fits        the memory model (ddpexp.predict.memory) on fake tensors: the largest rank's parameters,
              gradients, optimizer state, activations, the backward's temporaries and FSDP's buffers
              at the step's peak, against the device's memory less a reserve (conf/cluster: reserve_gib)
  step time   each rank's ops, recorded in the same fake forward and backward (ddpexp.predict.ops),
              timed on the device's profile (ddpexp.predict.device, conf/devices); then the
              communication Strategy.communication declares, on the profile's links (conf/interconnect),
              each call hiding behind its share of its pass; then the optimizer's step (timing.py).
              --mfu (or achieved_mfu in a profile) times the compute at that share of the peak instead
  cost        steps to the target (--tokens or --epochs) x step time x devices x price per device-hour
  ranges      time and cost from the smallest to the largest measured / predicted step time of the
              step-time model's held-out validation (ddpexp.predict.validation: ddpexp's record, or
              --validation FILE)

A layout given on the command line (strategy=...) is planned as given, one row. A language model
without data= is planned on synthetic tokens at its context length. A candidate is first checked as
pre-flight would check its command under torchrun on the cluster; `--emit` writes the file that runs
the recommended one (emit.py); on a profile of this machine (conf/cluster/cpu_host.yaml) `--verify K`
runs the first K (verify.py). record.py predicts the published runs of others (published_record.yaml).

The package, one concern a module:
  profiles.py   cluster profiles (conf/cluster/*.yaml) and their checks
  space.py      the meshes and the settings a candidate sets
  search.py     the search over them (or the layout given)
  estimate.py   the job, and one estimate of a candidate
  timing.py     a step's compute, exposed communication and optimizer step
  emit.py       the torchrun script, sbatch script or SkyPilot task of a plan
  picture.py    --plot FILE: predicted time against cost, a point per plan
  verify.py     --verify K: the first K plans run on this machine, and the regret of the first choice
  record.py     the published record: its rows, predictions, targets and the search's choices
  cli.py        the command line, the table (--format table|md|csv|json), the recommendation
"""

from .cli import main

__all__ = ["main"]
