"""The training loop of ``t5x-optim train``, and the job it runs.

- `config`: the job (`TrainJob`) read from gin files and flags;
- `train`: set-up, the jitted step, checkpoints, evaluation and the loop;
- `input`: each process's part of a global batch;
- `metrics` (event files on any storage: `event_files`), `progress`,
  `summary` and `weight_metrics`: what the loop reports;
- `interrupt`: Ctrl-C and signals turned into a clean stop.

Imports the demo model and data (`t5x_optim.cli.demo`) and public modules only.
"""
