"""verl's `skip.rollout`: a training step's generation dumped on one run and loaded instead of generated on the next.

A debugging aid for the trainer side of a run (the update, the advantage, the reward) when generation is the slow
part: the first run generates and dumps each listed step's rollout, later runs with the same shape load it.
Semantics as verl 0.10's `verl.utils.skip` (`RolloutSkip`, verl-project/verl 1dda039b):

- only the training steps in `skip.rollout.steps` are touched (verl's default `[]` touches none); validation never;
- the dumps live in `<dump_dir>/<experiment_name>_<project_name>/GBS<gen batch>_N<n>_in<prompt len>_out<response
  len>/<step>/` (`gen_batch.pkl` + `meta.json`), so a run of another shape or name does not load them;
- `action=cache`: a step whose dump exists loads it; one without generates and dumps;
- `action=repeat`: the step's own dump, else the latest dumped step before it, else the first after it; with no dump
  at all, the step generates and dumps.

What is dumped is the rollout engine's output (prompts, responses, their logprobs, the prompt fields that ride on
them); the reward, reference, values and advantages are computed again from it on every run. DAPO's later
generation rounds of a step (algorithm.filter_groups) are dumped beside the first as `gen_batch_r<round>.pkl`, and
ReMax's greedy baseline is generated every run. A dump that is unreadable or does not hold the step's
prompts x n samples is an error naming its file.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Callable

from tiller.errors import DataError
from tiller.protocol import Batch

META = "meta.json"


class RolloutSkip:
    """`skip.rollout` of an RL config; `generate(step, round_, fn)` returns the step's rollout and whether it was
    loaded from a dump."""

    def __init__(self, cfg) -> None:
        skip, data, tr = cfg.skip.rollout, cfg.data, cfg.trainer
        self.enable, self.steps, self.action = skip.enable, set(skip.steps), skip.action
        gbs = data.gen_batch_size or data.train_batch_size
        n = cfg.actor_rollout_ref.rollout.n
        self.samples = gbs * n
        self.root = (Path(skip.dump_dir).expanduser().resolve() / f"{tr.experiment_name}_{tr.project_name}"
                     / f"GBS{gbs}_N{n}_in{data.max_prompt_length}_out{data.max_response_length}")

    def _file(self, step: int, round_: int) -> Path:
        return self.root / str(step) / ("gen_batch.pkl" if round_ == 1 else f"gen_batch_r{round_}.pkl")

    def _ready(self, step: int, round_: int) -> bool:
        return (self.root / str(step) / META).is_file() and self._file(step, round_).is_file()

    def _dumped_steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return sorted(int(p.name) for p in self.root.iterdir() if p.name.isdigit() and self._ready(int(p.name), 1))

    def source_step(self, step: int, round_: int = 1) -> int | None:
        """The step whose dump `step` loads, or None (generate and dump)."""
        if not self.enable or step not in self.steps:
            return None
        if self._ready(step, round_):
            return step
        if self.action != "repeat":
            return None
        dumped = [s for s in self._dumped_steps() if self._ready(s, round_)]
        before = [s for s in dumped if s < step]
        after = [s for s in dumped if s > step]
        return before[-1] if before else (after[0] if after else None)

    def generate(self, step: int, round_: int, fn: Callable[[], Batch]) -> tuple[Batch, int | None]:
        """(`fn()`'s rollout, None), dumped when the step is listed; or (a dumped rollout, the step it came from)."""
        source = self.source_step(step, round_)
        if source is not None:
            return self._load(self._file(source, round_)), source
        batch = fn()
        if self.enable and step in self.steps:
            self._dump(step, round_, batch)
        return batch, None

    def _load(self, path: Path) -> Batch:
        try:
            with open(path, "rb") as f:
                batch = pickle.load(f)
        except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError) as err:
            raise DataError(f"{path}: not a readable skip.rollout dump ({type(err).__name__}: {err})") from None
        if not isinstance(batch, Batch) or len(batch) != self.samples:
            got = f"{len(batch)} samples" if isinstance(batch, Batch) else type(batch).__name__
            raise DataError(f"{path}: skip.rollout dump holds {got}, this run's step generates {self.samples} "
                            "(gen batch x rollout.n)")
        print(f"tiller: skip.rollout: loaded {path} instead of generating", flush=True)
        return batch

    def _dump(self, step: int, round_: int, batch: Batch) -> None:
        directory = self.root / str(step)
        directory.mkdir(parents=True, exist_ok=True)
        path = self._file(step, round_)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            pickle.dump(batch, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)
        meta = directory / META
        tmp = meta.with_name(META + ".tmp")
        tmp.write_text(json.dumps({"global_steps": step}) + "\n")
        os.replace(tmp, meta)  # written last: a dump without it is not loaded
        print(f"tiller: skip.rollout: dumped step {step}'s rollout to {path}", flush=True)
