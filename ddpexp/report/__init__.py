"""`python -m ddpexp.report DIR [DIR ...]` (or `ddpexp-report`): which strategy, and at what cost.

Every directory holding a metrics.json below the given ones is a run. Numbers come from the run's
metrics.json (facts, final, best, status, history, wall_s) and its TensorBoard events, read with
tensorboard's own event reader; nothing is re-measured. Written into the first directory given (or
--out), by --format:

  md (default)         report.md: one section per group (below), its table, notes and warnings
  csv, json            report.csv / report.json: one record per row, numbers as numbers (accuracy as a
                       fraction, times in seconds), with the row's group and warnings
  acc_vs_time.png      the best metric (eval/acc in %) against seconds since the job started, with the
                       --target line
  loss_vs_step.png     training loss against optimizer step, log scale; curves that coincide keep
                       markers of their own and say "identical to" in the legend
  loss_vs_cost.png     training loss against the tokens trained on (samples for data without tokens)
                       and against the bytes each rank sent (log scale), a panel each: loss at equal
                       tokens and at equal bytes moved (groups with measured communication only)
  throughput.png       samples/s per row (all devices; median, min-max bars when repeated)
  scaling.png          strong scaling (groups with a baseline whose device counts differ) and weak
                       scaling (below), one panel each; efficiencies > 1.05 ringed in red and labelled;
                       `plot_scaling` also draws predicted curves when given some (identical ones once)
Every plot and the table's strategy column label a row alike (labels.py).

The table is printed on stdout too (columns that are "-" in every row left out), then the notes and
every warning, one line each.

How runs are compared:
  group                runs with the same facts.model, facts.data and facts.global_batch_size; rows of
                       different groups are never compared with each other
  row                  runs that differ only in facts.seed / facts.repeat: the same facts otherwise (the
                       job's own clock and load readings aside) and the same run name once its seed=/repeat=
                       parts are taken out (the name carries overrides that facts do not, such as
                       trainer.epochs). Only completed runs are pooled; any other run is a row of its own.
  baseline             the group's row of --baseline NAME (a strategy label such as `single` or
                       `ddp comm_hook=bf16`, or a run's name) if given, else its completed `single` row
                       (facts.strategy == "single"; of several, the one labelled plain `single`, then the
                       one with most runs), else its one-process row (ddp on 1 process, as
                       experiment=scaling has). Never "the fastest one-device run". No baseline:
                       efficiency "-" and a warning (a note instead when weak scaling compares the group).
  weak scaling         rows of one model and data at one per-rank batch spanning several global batches
                       and device counts, with a one-process row among them: per-device samples/s
                       against that row's (experiment=scaling's trainer.batch_per_rank=32 runs)
  vs baseline          "no measurable difference" when the row's samples/s min-max range and the
                       baseline's overlap; otherwise the ratio of medians ("1.80x faster", "2.10x
                       slower"), marked "(n=1)" when either side ran once, so its spread is unknown

Definitions (also in the README):
  samples/s            per run: mean of perf/samples_per_s over its epochs, the first left out when there
                       are several (it includes warm-up); per row: median (min-max) over its runs
  per device           median samples/s / devices (processes on CPU, GPUs on CUDA)
  tokens/s, MFU        groups whose data has tokens (facts.tokens_per_sample): perf/tokens_per_s and
                       perf/mfu as samples/s is (per run the mean over its epochs, the first left out when
                       there are several); tokens/s as median (min-max), MFU the median, in %
  scaling eff.         (per device of the row) / (per device of the group's baseline), from medians
  final, best          the best metric's final / best value; a row of several runs: mean ± std (sample
                       standard deviation, in percentage points for accuracies)
  time to target       seconds from the job's start (facts.job_started_at, else the recorder's start)
                       until the best metric first reached --target (>= for max metrics, <= for min ones);
                       median (min-max) over the runs that reached it, "k of n" when some did not
  train time           metrics.json wall_s: from the recorder's start (data and model built) to its close
  job time             facts.job_ended_at - facts.job_started_at: the whole job, spawn and start-up
                       included; for runs recorded before job_ended_at, the recorder's close minus the job's
                       start (started_at + wall_s - job_started_at), else time_to_first_step_s + wall_s
  comm share           mean comm/share: fraction of training wall time with a gradient reduction running
  comm bytes/step      comm/bytes_per_step of the last epoch: the bytes each rank's gradient reductions
                       send per optimizer step (after PowerSGD's uncompressed start, when it ran that long)
  bytes moved          the bytes each rank sent in the whole run, in MB: each epoch's comm/bytes_per_step
                       x its steps, summed (metrics.json's history); median over the row's runs
  strategy             the strategy, with the settings that differ from its defaults (ddp comm_hook=bf16)
  bubble               pipeline runs, last epoch: pipe/bubble_frac (the measured share of a schedule step
                       spent outside the rank's stage) / pipe/bubble_frac_textbook ((p-1)/(m+p-1))
  staleness            ps async runs, last epoch: ps/staleness_mean / ps/staleness_max (server updates
                       between a worker's pull and its push)
  Several runs in a row: the other columns show the median over its runs.

Warnings (a marker [k] in the row's "warnings" column, the text under the table and on stdout):
  efficiency > 1.05    more than linear per-device speed cannot be real: the baseline was slowed
  oversubscribed       CPU runs: nprocs_per_node x threads > host_cpus (GPU runs' intra-op threads idle)
  no baseline          the group has no completed baseline row
  load                 the 1-minute load average (facts.load_avg_start / load_avg_end) against what the
                       run itself explains. busy threads = nprocs_per_node x threads on CPU (x 1 when
                       threads is unknown), nprocs_per_node on GPUs. At the start, the load left by the
                       previous job on the host (its load_avg_end, decayed with the average's 60 s time
                       constant over the gap) is set aside: what remains above the cores this run leaves
                       free (+0.5) was other work. At the end, the expected load is that other work +
                       the decayed rest + busy threads x (1 - exp(-job time / 60 s)); a reading further
                       than 0.5 x host_cpus from it means other work started or stopped during the run.
  different data       a group's runs with different facts.data_fingerprint (another Python's standard
                       library, an edited corpus, another vocabulary): their losses do not compare
  overlapped           two jobs on one machine (the same facts.machine, the kernel's boot id, which
                       containers share; else the same facts.host) whose [job_started_at, job_ended_at]
                       intervals (job_ended_at, else started_at + wall_s) intersect by more than 1 s:
                       each slowed the other (a sweep under a parallel launcher)
Facts a run lacks (older runs: threads, host_cpus, load_avg_*, job_ended_at, host, machine) give no warning.

The package, one concern a module:
  runs.py              a run's record (ddpexp.runrecord) and TensorBoard scalars: `Run`, `find_runs`
  rows.py              `Row`, `Group`, warnings' `Flag`, the baseline of a set of rows
  labels.py            one label per row (strategy, and what tells rows of one strategy apart)
  groups.py            runs pooled into rows and groups, the baseline, "vs baseline": `group_runs`
  weak.py              weak-scaling series across groups
  host_warnings.py     oversubscription, load and overlapping jobs, from the facts
  table.py             the table's cells (COLUMNS), as markdown or for a terminal
  records.py           --format csv|json
  plots.py             acc_vs_time, loss_vs_step and throughput PNGs, what all plots share
  scaling_plot.py      scaling.png; `plot_scaling` with predicted curves
  prediction.py        --predict: the cost model's curves (ddpexp.predict) for scaling.png
  cli.py               the command line (`main`)
"""

from .cli import main
from .groups import Group, Row, group_runs
from .records import records
from .runs import Run, find_runs, load_run

__all__ = ["Group", "Row", "Run", "find_runs", "group_runs", "load_run", "main", "records"]
