"""`ddpexp plan`: which strategy and mesh to use for a model on a cluster you are about to rent, and what
each costs, before anything runs.

    ddpexp plan model=llama3_1_8b data=synthetic_tokens task=lm data.block_size=4096 \
        trainer.batch_size=64 trainer.precision=bf16 optim=adamw --cluster 8xh100_sxm --tokens 1e9

For every candidate (`estimate.candidates`: the data-parallel strategies, nd's meshes of tensor
parallelism, pipeline stages and FSDP, HSDP over nodes, pipeline with replicas):

  fits        the memory model (ddpexp.predict.memory) on fake tensors: the largest rank's parameters,
              gradients, optimizer state, activations and the strategy's copies at the step's peak,
              against the device's memory less a reserve (conf/cluster: reserve_gib)
  step time   compute: the model's FLOPs per token x the global batch's tokens, at the device's dense
              peak for the precision x the profile's achieved_mfu (an assumption, stated with the
              profile), the strategy's share of it on the critical path (Strategy.compute_share); plus
              the communication Strategy.communication declares, on the profile's links
              (conf/interconnect), less what hides behind compute (ddpexp.predict's rule)
  cost        steps to the target (--tokens or --epochs) x step time x devices x price per device-hour
  ranges      time and cost from the smallest to the largest measured / predicted step time of the
              step-time model's held-out validation (ddpexp.predict.validation: ddpexp's record, or
              --validation FILE)

A candidate is first checked as pre-flight would check its command under torchrun on the cluster;
`--emit` writes the file that runs the recommended one (emit.py); on a profile of this machine
(conf/cluster/cpu_host.yaml) `--verify K` runs the first K (verify.py).

The package, one concern a module:
  profiles.py   cluster profiles (conf/cluster/*.yaml) and their checks
  estimate.py   the candidates and one estimate each
  emit.py       the torchrun script, sbatch script or SkyPilot task of a plan
  picture.py    --plot FILE: predicted time against cost, a point per plan
  verify.py     --verify K: the first K plans run on this machine, and the regret of the first choice
  cli.py        the command line, the table (--format table|md|csv|json), the recommendation
"""

from .cli import main

__all__ = ["main"]
