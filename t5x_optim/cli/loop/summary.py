"""What a run of `t5x-optim train` did: `TrainSummary`, printed at its end."""

from __future__ import annotations

import dataclasses

__all__ = ["TrainSummary"]


@dataclasses.dataclass(frozen=True)
class TrainSummary:
  """What a run did.

  Attributes:
    start_step: the step it started (or resumed) from.
    end_step: the step it stopped at.
    first_loss: train loss of its first step (None if it ran none).
    final_loss: train loss of its last step (its last finite one: a skipped step has none).
    eval_loss: the last held-out loss of the trained params.
    timed_steps: steps timed for the rate (all but the first, compiling one).
    timed_seconds: their wall time, evaluations and checkpoint saves excluded.
    checkpoint_dir: where the checkpoints are.
    checkpoint_step: the latest saved step.
    interrupted: stopped by Ctrl-C or SIGTERM.
    finished_before: the directory already held the finished run.
    tokens_per_step: tokens in a global batch, for the token rate (0: not shown).
    preempted: stopped by SIGTERM (a preemption).
    skipped_steps: non-finite steps skipped (``on_nonfinite = 'skip'``).
    eval_step: the step `eval_loss` is of (None: the end step).
    eval_others: the other losses of that eval line, by name: at the params the optimizer
      is evaluated at where those are others (``loss_slow``, ``loss_x``).

  Example:
    >>> print(TrainSummary(0, 10, 3.5, 1.25, 1.5, 9, 2.0, '/tmp/c', 10, False, False).format())
    steps 0 -> 10, 4.5 steps/s (9 steps in 2.0 s, compilation excluded)
    loss 3.5000 -> 1.2500, eval loss 1.5000
    checkpoint: step 10 in /tmp/c
  """

  start_step: int
  end_step: int
  first_loss: float | None
  final_loss: float | None
  eval_loss: float | None
  timed_steps: int
  timed_seconds: float
  checkpoint_dir: str
  checkpoint_step: int | None
  interrupted: bool
  finished_before: bool
  tokens_per_step: int = 0
  preempted: bool = False
  skipped_steps: int = 0
  eval_step: int | None = None
  eval_others: tuple[tuple[str, float], ...] = ()

  def format(self) -> str:
    lines = []
    if self.preempted:
      lines.append(f"preempted at step {self.end_step}")
    elif self.interrupted:
      lines.append(f"interrupted at step {self.end_step}")
    if self.timed_steps and self.timed_seconds > 0:
      steps_per_sec = self.timed_steps / self.timed_seconds
      tokens = (
        f", {steps_per_sec * self.tokens_per_step:,.0f} tokens/s" if self.tokens_per_step else ""
      )
      rate = (
        f"{steps_per_sec:.1f} steps/s{tokens} ({self.timed_steps} steps "
        f"in {self.timed_seconds:.1f} s, compilation excluded)"
      )
    else:
      rate = "too few steps to time"
    lines.append(f"steps {self.start_step} -> {self.end_step}, {rate}")
    if self.skipped_steps:
      lines.append(f"skipped {self.skipped_steps} non-finite steps")
    if self.final_loss is not None:
      evaluated = ""
      if self.eval_loss is not None:
        losses = (("eval loss", self.eval_loss), *self.eval_others)
        evaluated = "".join(f", {name} {value:.4f}" for name, value in losses)
        if self.eval_step not in (None, self.end_step):
          evaluated += f" (step {self.eval_step})"
      lines.append(f"loss {self.first_loss:.4f} -> {self.final_loss:.4f}{evaluated}")
    saved = "none" if self.checkpoint_step is None else f"step {self.checkpoint_step}"
    lines.append(f"checkpoint: {saved} in {self.checkpoint_dir}")
    return "\n".join(lines)
