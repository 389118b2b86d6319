"""Nothing lost in `rewrite train`: non-finite steps (`--on-nonfinite`) and failed saves (`--on-save-error`).

A step whose loss or gradient norm is not finite is never applied. Both numbers come out of
collectives (the step loss is reduced over the world, the gradient norm over tp, pp and dp), so
every rank holds the same two values and decides alike without another collective: every rank
skips the optimizer step, or every rank stops. A save that does not fit or fails is raised on
every rank by `save_training_state` (nothing of it left behind): the run stops, or trains on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint.finite import NonFiniteState
from ..checkpoint.training_state import latest_checkpoint, save_training_state
from ..errors import CheckpointWriteError, RewriteError
from .flag_words import in_flags

__all__ = ["ON_NONFINITE", "ON_SAVE_ERROR", "TrainStopped", "StateGuard"]

ON_NONFINITE = ("stop", "skip")
ON_SAVE_ERROR = ("stop", "continue")


class TrainStopped(RewriteError, RuntimeError):
    """`rewrite train` stopped before losing anything (a diverged step, its state never saved; a save
    that failed, removed); the same message on every rank."""


@dataclass
class StateGuard:
    """Decides, step by step, whether a step is applied, skipped or ends the run.

    Args:
        mode: "stop" (the first non-finite step ends the run) or "skip" (it is not applied;
            `limit` of them in a row end the run).
        limit: non-finite steps in a row that end a "skip" run.
        ckpt: the run's checkpoint directory, to name the last good state; None when it saves none.
        lr: the learning rate, for the advice.
        on_save_error: "stop" (a failed save ends the run) or "continue" (it trains on, and says so).
    """

    mode: str = "stop"
    limit: int = 5
    ckpt: str | None = None
    lr: float | None = None
    on_save_error: str = "stop"
    failed_saves: int = 0
    skipped: int = 0  # steps not applied in this run
    in_a_row: int = 0

    def applies(self, step: int, loss: float, grad_norm: float) -> bool:
        """True when the step's update may be applied; False when it is skipped.

        Raises:
            TrainStopped: the step is not finite under "stop", or the `limit`-th in a row under "skip".
        """
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.in_a_row = 0
            return True
        self.skipped += 1
        self.in_a_row += 1
        what = f"the loss is {loss:g} and the gradient norm {grad_norm:g}"
        if self.mode == "skip" and self.in_a_row < self.limit:
            return False
        if self.mode == "skip":
            what = (f"{self.in_a_row} steps in a row (steps {step - self.in_a_row + 1}-{step}) were not finite, "
                    f"the limit --skip-limit {self.limit}; at the last, {what}")
        raise TrainStopped(f"rewrite train stopped at step {step}: {what}; the step was not applied and nothing "
                           f"of it was saved. {self.where_good()}; {self.advice()}")

    def save(self, directory: str, stage, optimizer, scheduler, log, **kwargs) -> Path | None:
        """`save_training_state`, returning where it saved, or None when it failed and the run goes on.

        A state holding nan or inf (a finite step whose update was not) ends the run like a
        non-finite step. A save that did not fit or failed ends it under `on_save_error="stop"`;
        under "continue" it is said through `log.write` and the run trains on.

        Raises:
            TrainStopped: either, on every rank alike (both are agreed on by `save_training_state`).
        """
        step = kwargs.get("extra", {}).get("step")
        try:
            return save_training_state(directory, stage, optimizer, scheduler, **kwargs)
        except NonFiniteState as refused:
            raise TrainStopped(f"rewrite train stopped at step {step}: {refused}. {self.where_good()}; "
                               f"{self.advice()}") from None
        except CheckpointWriteError as failed:
            self.failed_saves += 1
            if self.on_save_error == "stop":
                raise TrainStopped(f"rewrite train stopped at step {step}: the training state was not saved: {failed}. "
                                   "Free space (or --keep fewer, or another --ckpt) and `--resume`; "
                                   "--on-save-error continue trains on without it") from None
            log.write(in_flags(f"warning: step {step}'s training state was not saved, training on (--on-save-error "
                               f"continue): {failed}"))
            return None

    def where_good(self) -> str:
        """The last finite state there is to go back to, in words."""
        if self.ckpt is None:
            return "The run saves no training state (no --ckpt), so there is nothing to resume from"
        found = latest_checkpoint(Path(self.ckpt))
        if found is None:
            return f"{self.ckpt} holds no checkpoint yet, so there is nothing to resume from"
        return f"The last finite training state is {found[1]} (step {found[0]}): `--resume` continues from it"

    def advice(self) -> str:
        lower = f"a lower --lr (this run's: {self.lr:g})" if self.lr is not None else "a lower --lr"
        also = "" if self.mode == "skip" else ", or --on-nonfinite skip to step over rare bad batches"
        return f"try {lower}, --max-grad-norm 1.0, a longer --warmup{also}"
