import pytest
import torch

from hf_lowzero import ZeroConfig


def test_defaults():
    cfg = ZeroConfig()
    assert (cfg.stage, cfg.reduce_bucket_mb, cfg.overlap_communication, cfg.clip_grad_norm) == (2, 25.0, True, 0.0)
    assert cfg.reduce_bucket_bytes == 25 * 2**20
    assert cfg.communication_dtype is None and cfg.process_group is None


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"stage": 3}, "stage"),
        ({"stage": 0}, "stage"),
        ({"reduce_bucket_mb": 0}, "reduce_bucket_mb"),
        ({"reduce_bucket_mb": -1.5}, "reduce_bucket_mb"),
        ({"reduce_bucket_mb": float("nan")}, "reduce_bucket_mb"),
        ({"reduce_bucket_mb": "25"}, "reduce_bucket_mb"),
        ({"clip_grad_norm": -1.0}, "clip_grad_norm"),
        ({"clip_grad_norm": float("inf")}, "clip_grad_norm"),
        ({"overlap_communication": "yes"}, "overlap_communication"),
        ({"communication_dtype": "int8"}, "communication_dtype"),
        ({"communication_dtype": torch.float64}, "communication_dtype"),
    ],
)
def test_invalid_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"ZeroConfig.{field}="):
        ZeroConfig(**kwargs)


@pytest.mark.parametrize("name,dtype", [("bf16", torch.bfloat16), ("float16", torch.float16), ("fp32", torch.float32)])
def test_communication_dtype_accepts_names(name, dtype):
    assert ZeroConfig(communication_dtype=name).communication_dtype is dtype


def test_overrides_are_validated_and_unknown_names_listed():
    cfg = ZeroConfig(stage=1)
    assert cfg.with_overrides(reduce_bucket_mb=1).reduce_bucket_mb == 1
    assert cfg.stage == 1
    with pytest.raises(TypeError, match="unknown ZeroConfig field"):
        cfg.with_overrides(bucket_size=3)
    with pytest.raises(ValueError, match="ZeroConfig.stage="):
        cfg.with_overrides(stage=5)


def test_trainer_flags_own_stage_and_clip_and_are_checked_with_zero_off(tmp_path):
    """``zero_config`` that is not JSON says so; it may repeat ``zero_stage``/``max_grad_norm`` but not
    contradict them; the ``zero_*`` knobs are validated with ``zero_stage=0`` too (issue 55)."""
    from hf_lowzero import LowZeroTrainingArguments

    def args(**kwargs):
        return LowZeroTrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, **kwargs)

    with pytest.raises(ValueError, match=r"zero_config='not json' is neither an existing file nor valid JSON \("):
        args(zero_stage=2, zero_config="not json")
    with pytest.raises(ValueError, match="zero_config sets stage=2 but zero_stage=1; zero_stage sets it"):
        args(zero_stage=1, zero_config='{"stage": 2}')
    with pytest.raises(ValueError, match=r"clip_grad_norm=0.5 but max_grad_norm=1.0; .* drop 'clip_grad_norm'"):
        args(zero_stage=2, zero_config='{"clip_grad_norm": 0.5}')
    same = args(zero_stage=1, max_grad_norm=0.5, zero_config='{"stage": 1, "clip_grad_norm": 0.5}')
    assert (same.to_zero_config().stage, same.to_zero_config().clip_grad_norm) == (1, 0.5)
    with pytest.raises(ValueError, match="reduce_bucket_mb"):
        args(zero_stage=0, zero_reduce_bucket_mb=-1)
    (tmp_path / "zero.json").write_text('{"initial_scale": 1024}')
    assert args(zero_stage=2, zero_config=str(tmp_path / "zero.json")).to_zero_config().initial_scale == 1024
