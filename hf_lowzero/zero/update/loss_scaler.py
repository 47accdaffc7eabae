"""Loss scaling for fp16 params, and the no-op scale used for bf16/fp32.

Example::

    >>> scaler = DynamicLossScaler.from_config(ZeroConfig(initial_scale=2.0**16, hysteresis=2))
    >>> scaler.update(overflow=True); scaler.scale      # first overflow: hysteresis absorbs it
    65536.0
    >>> scaler.update(overflow=True); scaler.scale      # second: back off
    32768.0

Policy (Megatron-LM's): an overflow resets the clean-step count and uses up one unit of
hysteresis; once hysteresis is exhausted every overflow multiplies the scale by
``backoff_factor`` (never below ``min_scale``). ``growth_interval`` consecutive clean steps
multiply it by ``growth_factor`` (never above ``max_scale``) and restore the hysteresis.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from hf_lowzero.zero.zero_config import ZeroConfig


@dataclass(kw_only=True)
class DynamicLossScaler:
    """The policy's parameters; their defaults and validation live in ``ZeroConfig``."""

    initial_scale: float
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    hysteresis: int
    min_scale: float
    max_scale: float

    @classmethod
    def from_config(cls, config: ZeroConfig) -> DynamicLossScaler:
        return cls(**{f.name: getattr(config, f.name) for f in fields(cls)})

    def __post_init__(self) -> None:
        self.scale = float(self.initial_scale)
        self.clean_steps = 0  # consecutive steps without overflow since the last change
        self.hysteresis_left = self.hysteresis

    @property
    def at_min_scale(self) -> bool:
        return self.scale <= self.min_scale

    def update(self, overflow: bool) -> None:
        if overflow:
            self.clean_steps = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.clean_steps = 0
            self.hysteresis_left = self.hysteresis
            self.scale = min(self.scale * self.growth_factor, self.max_scale)

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": "dynamic",
            "scale": self.scale,
            "clean_steps": self.clean_steps,
            "hysteresis_left": self.hysteresis_left,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.hysteresis_left = int(state["hysteresis_left"])


class ConstantScale:
    """bf16/fp32: no loss scaling (their exponent range does not underflow like fp16's)."""

    scale = 1.0
    at_min_scale = False

    def update(self, overflow: bool) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "constant", "scale": 1.0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def make_scaler(config: ZeroConfig, dtypes: set[torch.dtype]) -> DynamicLossScaler | ConstantScale:
    """fp16 params need dynamic loss scaling; bf16 and fp32 do not."""
    if torch.float16 not in dtypes:
        return ConstantScale()
    return DynamicLossScaler.from_config(config)
