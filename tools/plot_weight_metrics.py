"""Draws what TensorBoard shows of a run's per-parameter metrics, as one PNG.

Run: ``python tools/plot_weight_metrics.py MODEL_DIR OUT.png`` (needs
matplotlib: ``pip install '.[plot]'``).

Reads ``MODEL_DIR/train`` and ``MODEL_DIR/eval`` with TensorBoard's
`EventAccumulator` and draws five panels: the train and eval loss, then the
RMS of the weights, gradients and updates (``weight_rms/``,
``weight_gradient_rms/``, ``weight_update_rms/``) and of Adam's second
moment (``optimizer_state_rms/nu/``) for every kernel, one line per
parameter, as TensorBoard's charts for those tags do.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tensorboard.backend.event_processing import event_accumulator

PANELS = (
  ("weight_rms", "weight RMS"),
  ("weight_gradient_rms", "gradient RMS"),
  ("weight_update_rms", "update RMS"),
  ("optimizer_state_rms/nu", "Adam nu RMS"),
)


def _scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
  accumulator = event_accumulator.EventAccumulator(str(directory), size_guidance={"scalars": 0})
  accumulator.Reload()
  return {
    tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
    for tag in accumulator.Tags()["scalars"]
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("model_dir", type=Path)
  parser.add_argument("out", type=Path)
  args = parser.parse_args()
  import matplotlib  # noqa: PLC0415 - only this tool needs it

  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # noqa: PLC0415

  train, evaluation = _scalars(args.model_dir / "train"), _scalars(args.model_dir / "eval")
  figure, axes = plt.subplots(1, 1 + len(PANELS), figsize=(4 * (1 + len(PANELS)) + 2, 3.6))
  for name, series in (("train", train["loss"]), ("eval", evaluation["loss"])):
    axes[0].plot(*zip(*series, strict=True), label=name, marker="." if name == "eval" else None)
  axes[0].set(title="loss", xlabel="step", ylabel="nats per byte")
  axes[0].legend()
  for axis, (prefix, title) in zip(axes[1:], PANELS, strict=True):
    tags = sorted(t for t in train if t.startswith(prefix + "/") and "norm" not in t)
    colors = plt.get_cmap("tab20").colors
    for i, tag in enumerate(tags):
      name = tag[len(prefix) + 1 :]
      axis.plot(*zip(*train[tag], strict=True), label=name, linewidth=1, color=colors[i % 20])
    axis.set(title=f"train/{prefix}/*", xlabel="step", ylabel=title, yscale="log")
  axes[-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
  figure.tight_layout()
  figure.savefig(args.out, dpi=90)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
