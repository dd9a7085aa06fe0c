"""fp16 loss scaling with DeepSpeed's semantics (`fp16.loss_scale`, `initial_scale_power`, `loss_scale_window`,
`hysteresis`, `consecutive_hysteresis`, `min_loss_scale`).

The overflow decision itself is made by the sharded optimizer from the all-reduced gradient norm, so every rank
sees the same decision; this module only keeps the scale.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any


if TYPE_CHECKING:
    from accelerate_zero.config import ZeroConfig


@dataclass
class LossScalerState:
    scale: float
    iteration: int = 0
    """Optimizer steps seen (skipped ones included)."""
    last_overflow_iteration: int = -1
    hysteresis_left: int = 1
    """Overflows still tolerated before the scale is lowered."""


class LossScaler:
    """A static (`dynamic=False`) or dynamic loss scale.

    Dynamic: every overflow skips the step; once `hysteresis` overflows have been seen the scale is divided by 2
    (never below `min_scale`); after `window` steps without overflow it is multiplied by 2. With
    `consecutive_hysteresis`, every step without overflow refills the hysteresis. Overflowing again at the minimum
    scale raises, as DeepSpeed does.
    """

    def __init__(
        self,
        *,
        dynamic: bool,
        initial_scale: float,
        window: int = 1000,
        hysteresis: int = 2,
        consecutive_hysteresis: bool = False,
        min_scale: float = 1.0,
    ) -> None:
        self.dynamic, self.window, self.hysteresis = dynamic, window, hysteresis
        self.consecutive_hysteresis, self.min_scale = consecutive_hysteresis, min_scale
        self.state = LossScalerState(scale=float(initial_scale), hysteresis_left=hysteresis)

    @property
    def scale(self) -> float:
        return self.state.scale

    def update(self, overflow: bool) -> None:
        """Records one optimizer step's outcome and adjusts the scale."""
        state = self.state
        if self.dynamic and overflow:
            self._lower(state)
            state.last_overflow_iteration = state.iteration
        elif self.dynamic:
            if self.consecutive_hysteresis:
                state.hysteresis_left = self.hysteresis
            if (state.iteration - state.last_overflow_iteration) % self.window == 0:
                if not self.consecutive_hysteresis:
                    state.hysteresis_left = self.hysteresis
                state.scale *= 2.0
        state.iteration += 1

    def _lower(self, state: LossScalerState) -> None:
        if self.hysteresis > 1 and state.hysteresis_left > 1:
            state.hysteresis_left -= 1
            return
        if state.scale <= self.min_scale:
            raise RuntimeError(
                "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run. "
                f"(fp16.min_loss_scale={self.min_scale}); the gradients keep overflowing: lower the learning rate, "
                "check the data for inf/nan, or train in bf16"
            )
        state.scale = max(state.scale / 2.0, self.min_scale)

    def state_dict(self) -> dict[str, Any]:
        return asdict(self.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = LossScalerState(**state)


def build_loss_scaler(config: ZeroConfig) -> LossScaler | None:
    """The fp16 loss scaler the config asks for; None unless `fp16.enabled`."""
    fp16 = config.fp16
    if not fp16.enabled:
        return None
    dynamic = fp16.loss_scale == 0
    return LossScaler(
        dynamic=dynamic,
        initial_scale=2.0**fp16.initial_scale_power if dynamic else fp16.loss_scale,
        window=fp16.loss_scale_window,
        hysteresis=fp16.hysteresis,
        consecutive_hysteresis=fp16.consecutive_hysteresis,
        min_scale=fp16.min_loss_scale,
    )
