"""Which input sets a verification compares: drawn from one seeded stream, only where the original runs.

Some originals fail on some inputs: torchvision's Keypoint R-CNN stops at a Reshape of zero rows on
inputs in [0, 255], and whether Mask R-CNN does depends on the draw. A rewrite can only be compared where
the original computes something, so at each batch size (ascending) verification wants ``runs`` compared
input sets, their kinds in trial order (trial ``t``: kind ``t mod 4``, ``verify_inputs``), and:

- a draw on which the original fails is not compared; its kind is drawn again (fresh values from the same
  stream), up to ``ATTEMPTS`` draws in a row. A kind that fails them all leaves that batch size's walk;
  if it never ran there it is **skipped**: recorded with the original's first error and the batch size,
  and not drawn at later batch sizes either. The walk goes on through the other kinds (cycling) until
  ``runs`` sets were compared, so a plain model that fails on noise is compared on ``uniform`` and
  ``shapes`` instead, and a detector on every kind it runs.
- until the original has run once at a batch size, each kind gets one draw in turn, and the kinds that
  failed theirs get their other draws as soon as one runs: a batch size at which the first draw of every
  kind fails is taken not to run at all (a graph that pins the batch despite a symbolic dim) and is left
  out after one failed run per kind, not ``ATTEMPTS``; its failures skip no kind.
- the candidate failing where the original ran, or differing from it, ends verification (the comparison
  raises); it is never retried.

The minimum for accepting a rewrite: at least one batch size with at least one compared input set (every
batch size that runs has one by the rule above). One input set compares every element of every output;
the rewrites are the same for every input, so a wrong one shows there. The caller raises
OptimizationError naming the original's first error when not even that was compared.

Every draw and decision follows from the seed and from where the original fails, in a fixed order: a
second comparison of the same original (the fed comparison of ``verify_fed``) draws exactly the input sets
the first one drew, and compares the same ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from service.optimizer.verify_inputs import INPUT_KINDS, kind_of_trial

ATTEMPTS = 3
"""Draws of one kind at one batch size before the kind is skipped."""

Draw = Callable[[int, str, np.random.Generator], dict[str, np.ndarray]]
"""(batch, kind, rng) -> one input set."""
Attempt = Callable[[int, str, dict[str, np.ndarray]], "str | None"]
"""(batch, kind, input set) -> None when the original ran and the candidate matched it (a mismatch or a
failing candidate raises), else the original's error, short."""


@dataclasses.dataclass(frozen=True)
class Step:
    batch: int
    kind: str
    compared: bool


@dataclasses.dataclass
class DrawLog:
    """What a verification drew and compared, in order."""

    steps: list[Step] = dataclasses.field(default_factory=list)
    batches: list[int] = dataclasses.field(default_factory=list)
    """The batch sizes at which something was compared."""
    used: list[str] = dataclasses.field(default_factory=list)
    """The kinds compared somewhere, in order of first use."""
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    """Kind -> ``at batch B: <the original's first error>``."""
    first_failure: str = ""


def draw_and_compare(batch_sizes: Sequence[int], runs: int, seed: int, draw: Draw, attempt: Attempt) -> DrawLog:
    """Walk the batch sizes as the module docstring says; the caller checks that ``batches`` is not empty."""
    rng = np.random.default_rng(seed)
    log = DrawLog()
    for batch in batch_sizes:
        _Batch(batch, rng, draw, attempt, log).run(max(1, runs))
    return log


class _Batch:
    """One batch size's walk through the kinds."""

    def __init__(self, batch: int, rng: np.random.Generator, draw: Draw, attempt: Attempt, log: DrawLog) -> None:
        self.batch, self.rng, self.draw, self.attempt, self.log = batch, rng, draw, attempt, log
        self.live = [kind for kind in INPUT_KINDS if kind not in log.skipped]
        self.ran: set[str] = set()
        self.first_error: dict[str, str] = {}
        self.compared = 0

    def run(self, runs: int) -> None:
        waiting: list[str] = []  # failed their first draw before the original ran here
        trial = 0
        while self.compared < runs and self.live:
            kind = kind_of_trial(trial)
            trial += 1
            if kind in waiting and set(waiting) >= set(self.live):
                break  # the first draw of every kind failed: this batch size does not run
            if kind not in self.live or kind in waiting:
                continue
            if self._turn(kind, ATTEMPTS if self.compared else 1):
                for owed in waiting:  # the batch runs: the kinds that waited get their other draws
                    self._turn(owed, ATTEMPTS - 1)
                waiting = []
            elif not self.compared:
                waiting.append(kind)
        if self.compared:
            self.log.batches.append(self.batch)

    def _turn(self, kind: str, draws: int) -> bool:
        """Up to ``draws`` input sets of ``kind`` until the original runs on one. Once the batch runs, a
        turn that fails takes the kind out of this batch's walk, and skips it when it never ran here."""
        for _ in range(draws):
            feeds = self.draw(self.batch, kind, self.rng)
            error = self.attempt(self.batch, kind, feeds)
            self.log.steps.append(Step(self.batch, kind, error is None))
            if error is None:
                self.compared += 1
                self.ran.add(kind)
                if kind not in self.log.used:
                    self.log.used.append(kind)
                return True
            self.first_error.setdefault(kind, error)
            self.log.first_failure = self.log.first_failure or error
        if self.compared:
            self.live.remove(kind)
            if kind not in self.ran:
                self.log.skipped[kind] = f"at batch {self.batch}: {self.first_error[kind]}"
        return False
