"""`--device auto` / `--dtype auto`: the choice from what torch sees and what config.json declares."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.worker.hardware import decide, model_dtype


def test_auto_picks_cuda_and_the_model_dtype_when_torch_sees_a_gpu() -> None:
    choice = decide("auto", "auto", cuda_devices=1, model_dtype="float16")
    assert (choice.device, choice.dtype) == ("cuda", "float16")
    assert "torch sees a CUDA device" in choice.why and "float16" in choice.why


def test_float32_models_run_in_bfloat16_on_cuda_and_float32_on_cpu() -> None:
    assert decide("auto", "auto", cuda_devices=2, model_dtype="float32").dtype == "bfloat16"
    assert decide("cuda:1", "auto", cuda_devices=0, model_dtype=None).dtype == "bfloat16"
    cpu = decide("auto", "auto", cuda_devices=0, model_dtype="bfloat16")
    assert (cpu.device, cpu.dtype) == ("cpu", "float32")
    assert "no CUDA device" in cpu.why


def test_explicit_choices_and_vllm_spellings_are_kept() -> None:
    assert decide("cpu", "half", cuda_devices=1, model_dtype=None).describe() == "device cpu, dtype float16 (as given)"
    assert decide("cuda", "float", cuda_devices=1, model_dtype="bfloat16").dtype == "float32"


@pytest.mark.parametrize(("device", "dtype"), [("tpu", "auto"), ("cpu", "int8")])
def test_unknown_devices_and_dtypes_are_refused(device: str, dtype: str) -> None:
    with pytest.raises(ValueError, match="must be"):
        decide(device, dtype, cuda_devices=0, model_dtype=None)


def test_model_dtype_reads_either_spelling(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    assert model_dtype(tmp_path) == "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float16", "torch_dtype": "float32"}))
    assert model_dtype(tmp_path) == "float16"
    (tmp_path / "config.json").write_text("not json")
    assert model_dtype(tmp_path) is None
