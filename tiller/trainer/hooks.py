"""Step hooks: what a front end (tiller.trl's TRL callbacks) sees of a training loop while it runs, and what it may ask.

The SFT / RM / DPO / KTO / SPIN job loop (`tiller.trainer.loop.run_training`) and the RL loop (`RLTrainer.fit`) call the
installed hooks (`installed(hooks)`, one process, the loop's own thread):

- `begin(info)` before the first step: `total` and `start` steps, and the live objects where the loop has them
  (`model`, `optimizer`, `lr_scheduler`, `tokenizer`);
- `epoch_begin(epoch)` before the first step of each epoch (and of a resumed run's first, partial one);
  `step_begin(step)` before each step (`step` steps done);
- `step(step, metrics)` after each step's metrics are logged (the row metrics.jsonl gets, validation included when
  the step validated); it returns `Requests`: `evaluate` (validate now; the row is logged and `evaluated` is called),
  `save` (a checkpoint now), `stop` (end training after this step; a checkpoint of it is saved, so the run's last
  state is the one a later export or resume reads);
- `evaluated(step, metrics)` after a validation the hooks asked for; `saved(step, path)` after every checkpoint;
- `epoch_end(step)` after the last step of each epoch (after that step's validation and checkpoint; also after the
  run's last step and a step the hooks stopped at, as transformers ends an epoch then); it returns `Requests` too,
  served as a step's (a validation or a checkpoint of that step not made yet, stop);
- `end(step, metrics)` after the last step (stopped or not), before the export.

No hooks installed: the loops run as before (`current()` is None).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Protocol


@dataclass
class Requests:
    """What a step's hooks ask of the loop."""

    stop: bool = False
    save: bool = False
    evaluate: bool = False


class StepHooks(Protocol):
    def begin(self, info: dict[str, Any]) -> None: ...

    def epoch_begin(self, epoch: int) -> None: ...

    def step_begin(self, step: int) -> None: ...

    def step(self, step: int, metrics: dict[str, Any]) -> Requests: ...

    def epoch_end(self, step: int) -> Requests: ...

    def evaluated(self, step: int, metrics: dict[str, Any]) -> None: ...

    def saved(self, step: int, path: Any) -> None: ...

    def end(self, step: int, metrics: dict[str, Any]) -> None: ...


_current: StepHooks | None = None


def current() -> StepHooks | None:
    """The installed hooks, or None."""
    return _current


@contextlib.contextmanager
def installed(hooks: StepHooks | None) -> Iterator[None]:
    """Install `hooks` for the loops run inside the block (None: leave things as they are)."""
    global _current
    before = _current
    if hooks is not None:
        _current = hooks
    try:
        yield
    finally:
        _current = before
