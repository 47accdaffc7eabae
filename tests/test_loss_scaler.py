"""DynamicLossScaler policy: hysteresis, backoff, growth, clamps and state round trip."""

import pytest

from hf_lowzero import ZeroConfig
from hf_lowzero.zero.update.loss_scaler import ConstantScale, DynamicLossScaler


def scaler(**knobs) -> DynamicLossScaler:
    return DynamicLossScaler.from_config(ZeroConfig(**knobs))


def test_backs_off_only_after_hysteresis_overflows():
    s = scaler(initial_scale=1024, hysteresis=2, backoff_factor=0.5)
    s.update(overflow=True)
    assert s.scale == 1024
    s.update(overflow=True)
    assert s.scale == 512
    s.update(overflow=True)  # hysteresis stays used up until the scale grows again
    assert s.scale == 256


def test_grows_after_growth_interval_clean_steps_and_restores_hysteresis():
    s = scaler(initial_scale=64, growth_interval=3, hysteresis=2)
    s.update(overflow=True)
    s.update(overflow=True)
    assert s.scale == 32
    for _ in range(2):
        s.update(overflow=False)
    assert s.scale == 32
    s.update(overflow=False)
    assert s.scale == 64 and s.hysteresis_left == 2
    s.update(overflow=False)
    s.update(overflow=True)  # an overflow resets the clean-step count
    for _ in range(2):
        s.update(overflow=False)
    assert s.scale == 64


def test_scale_is_clamped():
    s = scaler(initial_scale=4, min_scale=2, max_scale=8, hysteresis=1, growth_interval=1)
    for _ in range(3):
        s.update(overflow=True)
    assert s.scale == 2 and s.at_min_scale
    for _ in range(5):
        s.update(overflow=False)
    assert s.scale == 8


def test_state_round_trip():
    s = scaler(initial_scale=2.0**16, growth_interval=10)
    for overflow in (True, False, False, True, True, False):
        s.update(overflow)
    t = scaler(initial_scale=2.0**16, growth_interval=10)
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()
    for overflow in (False,) * 9:
        s.update(overflow)
        t.update(overflow)
    assert t.scale == s.scale == 2.0**15  # 65536 -> two backoffs -> 16384 -> grows once


@pytest.mark.parametrize("overflow", [True, False])
def test_constant_scale_never_changes(overflow):
    c = ConstantScale()
    c.update(overflow)
    assert c.scale == 1.0 and not c.at_min_scale
