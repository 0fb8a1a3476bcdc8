"""Session-wide fixtures: tiny Qwen2 and Llama models built with the tiny-model kit, one torch thread.

The models (~1.1M parameters, 512-token byte-level BPE vocabulary trained on the built-in corpus of
English, digits and arithmetic) are built once per test session into a temp dir and loaded by tests
through `from_pretrained`, exactly as a user's model dir would be.
"""

from __future__ import annotations

import os

import pytest
import torch

# one thread by default (a busy 2-core host runs 1 thread best); TILLER_TEST_THREADS=2 runs the suite with 2,
# to check that no test depends on the reduction order a thread count gives
torch.set_num_threads(int(os.environ.get("TILLER_TEST_THREADS", "1")))
# ... and the processes tests start (tiller's CLIs, servers, workers) as many, unless the caller set a count: under
# `pytest -n 2` on 2 cores two workers' 2-thread children would oversubscribe the cores (OpenMP threads then spin
# waiting for each other, several times slower)
os.environ.setdefault("OMP_NUM_THREADS", os.environ.get("TILLER_TEST_THREADS", "1"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Path to a saved ~1.1M-parameter Qwen2-architecture model + tokenizer (seed 0)."""
    from tiller.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", arch="qwen2", n_params=1_000_000, seed=0)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """Path to a saved ~1.1M-parameter Llama-architecture model + tokenizer (seed 0)."""
    from tiller.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", arch="llama", n_params=1_000_000, seed=0)


@pytest.fixture
def fake_vllm(monkeypatch):
    """A stand-in `vllm` module at sys.modules["vllm"] (see tests/fake_vllm.py)."""
    from tests.fake_vllm import install

    return install(monkeypatch)


@pytest.fixture
def force_bf16(monkeypatch):
    """bf16 compute on, whatever this host's CPU decides: the bf16 code paths run (slowly on AVX2) everywhere."""
    from tiller import hostinfo

    monkeypatch.setattr(hostinfo, "_DECISION", hostinfo.Bf16Decision(True, "forced on by the test"))


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory):
    """Path to a saved ~1.1M-parameter Qwen2-VL (vision tower + LM) with tokenizer and image processor (seed 0)."""
    from tiller.models.tiny_vlm import make_tiny_vlm

    return make_tiny_vlm(tmp_path_factory.mktemp("tiny") / "qwen2vl", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3vl_dir(tmp_path_factory):
    """Path to a saved ~1.3M-parameter Qwen3-VL (deepstack vision tower + Qwen3 LM, patch 16) with tokenizer and
    image processor (seed 0)."""
    from tiller.models.tiny_vlm import make_tiny_vlm

    return make_tiny_vlm(tmp_path_factory.mktemp("tiny") / "qwen3vl", seed=0, model_type="qwen3_vl")


@pytest.fixture(scope="session")
def tiny_qwen3vl_moe_dir(tmp_path_factory):
    """Path to a saved ~1.3M-parameter Qwen3-VL-MoE (the tiny Qwen3-VL with every layer's MLP 4 experts, top-2,
    Qwen3-VL-30B-A3B's layout) with tokenizer and image processor (seed 0)."""
    from tiller.models.tiny_vlm import make_tiny_vlm

    return make_tiny_vlm(tmp_path_factory.mktemp("tiny") / "qwen3vlmoe", seed=0, model_type="qwen3_vl_moe")


VLM_FIXTURES = {"qwen2_vl": "tiny_vlm_dir", "qwen3_vl": "tiny_qwen3vl_dir", "qwen3_vl_moe": "tiny_qwen3vl_moe_dir",
                "qwen3_5": "tiny_qwen3_5_vlm_dir", "qwen3_5_moe": "tiny_qwen3_5_moe_vlm_dir", "glm4v": "tiny_glm4v_dir",
                "glm4v_moe": "tiny_glm4v_moe_dir"}


@pytest.fixture(scope="session")
def tiny_qwen3_5_vlm_dir(tmp_path_factory):
    """Path to a saved tiny Qwen3.5 (`qwen3_5`: Gated DeltaNet and gated attention layers, Qwen3-VL's vision tower)
    with tokenizer and image processor (patch 16, 128x128 images; seed 0)."""
    from tiller.models.tiny_vlm import make_tiny_vlm

    return make_tiny_vlm(tmp_path_factory.mktemp("tiny") / "qwen3_5", seed=0, model_type="qwen3_5")


@pytest.fixture(scope="session")
def tiny_qwen3_5_moe_vlm_dir(tmp_path_factory):
    """Path to a saved ~1.3M-parameter Qwen3.5-MoE (`qwen3_5_moe`: the tiny Qwen3.5 with every layer's MLP 4 experts,
    top-2, and a shared expert) with tokenizer and image processor (seed 0)."""
    from tiller.models.tiny_vlm import make_tiny_vlm

    return make_tiny_vlm(tmp_path_factory.mktemp("tiny") / "qwen3_5_moe", seed=0, model_type="qwen3_5_moe")


@pytest.fixture(scope="session")
def tiny_glm4v_dir(tmp_path_factory):
    """Path to a saved ~1.2M-parameter GLM-4.1V (`glm4v`: GLM-4's language model with half-head M-RoPE, an untied LM
    head, its vision tower at patch 14) with GLM's tokens, chat template and image processor (112x112 images; seed
    0)."""
    from tiller.models.tiny_vlm import make_tiny_vlm

    return make_tiny_vlm(tmp_path_factory.mktemp("tiny") / "glm4v", seed=0, model_type="glm4v")


@pytest.fixture(scope="session")
def tiny_glm4v_moe_dir(tmp_path_factory):
    """Path to a saved ~1.5M-parameter GLM-4.5V (`glm4v_moe`: GLM-4.1V's vision tower before GLM-4.5-Air's language
    model: a dense first layer, then 4 routed experts, top-2, sigmoid routing, a shared expert) with GLM's tokens,
    chat template and image processor (112x112 images; seed 0)."""
    from tiller.models.tiny_vlm import make_tiny_vlm

    return make_tiny_vlm(tmp_path_factory.mktemp("tiny") / "glm4v_moe", seed=0, model_type="glm4v_moe")


@pytest.fixture(scope="session", params=list(VLM_FIXTURES))
def any_vlm_dir(request):
    """The tiny Qwen2-VL, Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE, GLM-4.1V and GLM-4.5V: a test taking this runs
    on each model type."""
    return request.getfixturevalue(VLM_FIXTURES[request.param])


# The longest modules first (their share of a fast-lane run on a 2-core Xeon under `-n 2`: test_readme ~26%, the
# next ones 3-8% each). xdist's `--dist loadscope` hands modules to the workers in collection order as they free
# up, so a long module collected late leaves the other worker idle at the end; longest-first keeps the tail short.
# Only the order changes (stable sort): every module's tests still run in their own order.
LONG_MODULES_FIRST = ("tests/test_readme.py", "tests/trainer/test_rl.py", "tests/distributed/test_ray_groups.py",
                      "tests/trainer/test_async_rl.py", "tests/test_verl_edge.py", "tests/test_config.py",
                      "tests/distributed/test_rl_ray.py", "tests/trainer/test_run_dir.py")


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(LONG_MODULES_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


def save_tiny_variant(out_dir, tokenizer_dir, **overrides):
    """The tiny Qwen2 (hidden 128: 4 attention heads of 32) with config `overrides`, saved with `tokenizer_dir`'s
    tokenizer to `out_dir`: sequence parallelism over 2 ranks needs heads that split in two."""
    from transformers import AutoTokenizer

    from tiller.models.tiny import build_model

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    build_model(tok, hidden_size=128, num_layers=2, **overrides).save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def tiny_even_heads_dir(tmp_path_factory, tiny_model_dir):
    """`save_tiny_variant` with its defaults: 4 query and 4 key / value heads."""
    return save_tiny_variant(tmp_path_factory.mktemp("tiny") / "qwen2_kv4", tiny_model_dir)


@pytest.fixture(scope="session")
def layer_kind_dir(tmp_path_factory, tiny_model_dir):
    """`get(model_type)`: the path of a saved tiny model of that family (`tests/layer_kinds.py`), built once."""
    from tests.layer_kinds import build

    built = {}

    def get(model_type: str):
        if model_type not in built:
            built[model_type] = build(model_type, tiny_model_dir, tmp_path_factory.mktemp("kinds") / model_type)
        return built[model_type]

    return get
