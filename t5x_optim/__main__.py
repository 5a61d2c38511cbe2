"""``python -m t5x_optim``: the `t5x-optim` command line."""

from t5x_optim.cli import console_main

if __name__ == "__main__":
  console_main()
