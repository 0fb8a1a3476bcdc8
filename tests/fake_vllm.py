"""A stand-in `vllm` module for tests (vLLM itself is an optional GPU extra, not installed here).

`FakeLLM` answers like vLLM's offline `LLM` (RequestOutput with CompletionOutput token ids, per-step
logprob dicts, finish reasons) and records what it is asked: `calls` (SamplingParams, sleep / wake_up),
`loaded` (each `load_weights` call as a name -> tensor dict) and `events`, every call in order
("generate", "load_weights", "sleep", "wake_up"). The `fake_vllm` fixture (tests/conftest.py) installs it.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from typing import ClassVar


@dataclass
class _Logprob:
    logprob: float


class FakeLLM:
    instances: ClassVar[list] = []

    def __init__(self, model, logprobs_mode=None, **kwargs):
        self.model_dir, self.kwargs, self.logprobs_mode = model, kwargs, logprobs_mode
        self.loaded, self.calls, self.events = [], [], []
        FakeLLM.instances.append(self)

    def generate(self, requests, sampling_params, use_tqdm=False):
        self.calls.append(sampling_params)
        self.events.append("generate")
        outs = []
        for req in requests:
            completions = []
            for j in range(sampling_params.n):
                # token k of sample j: (first prompt token + 10 j + k) % 50, logprob -(k + 1) / 10
                toks = [(req["prompt_token_ids"][0] + 10 * j + k) % 50 for k in range(sampling_params.max_tokens)]
                lps = [{t: _Logprob(-(k + 1) / 10)} for k, t in enumerate(toks)]
                completions.append(types.SimpleNamespace(token_ids=toks, logprobs=lps, finish_reason="length"))
            outs.append(types.SimpleNamespace(outputs=completions))
        return outs

    def apply_model(self, func):
        return [func(self)]

    def load_weights(self, weights):
        self.loaded.append({name: t.clone() for name, t in weights})
        self.events.append("load_weights")

    def sleep(self, level=1):
        self.calls.append(("sleep", level))
        self.events.append("sleep")

    def wake_up(self):
        self.calls.append("wake_up")
        self.events.append("wake_up")


def install(monkeypatch) -> types.ModuleType:
    """Put the stand-in at sys.modules["vllm"] (undone by monkeypatch) and clear FakeLLM.instances."""
    module = types.ModuleType("vllm")
    module.LLM = FakeLLM
    module.SamplingParams = lambda **kw: types.SimpleNamespace(**kw)
    monkeypatch.setitem(sys.modules, "vllm", module)
    FakeLLM.instances.clear()
    return module
