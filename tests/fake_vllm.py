"""A stand-in `vllm` module for the fast default lane (the real engine runs in the `vllm` lane:
tests/vllm/, where `import vllm` works).

`FakeLLM` answers like vLLM's offline `LLM` (RequestOutput with CompletionOutput token ids, per-step
logprob dicts, finish reasons) and records what it is asked: `calls` (the SamplingParams of each generate
call, one per prompt; sleep / wake_up), `loaded` (each `load_weights` call as a name -> tensor dict) and
`events`, every call in order ("generate", "load_weights", "sleep", "wake_up"). Like vLLM's V1 engine,
whose workers live in other processes, it refuses to ship a function (`apply_model`, or a callable in
`collective_rpc`'s arguments): only plain values cross, and `collective_rpc` calls the method by name on
an in-process worker built from the `worker_extension_cls` it was given. The `fake_vllm` fixture
(tests/conftest.py) installs it.
"""

from __future__ import annotations

import importlib
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
        self.worker = None
        if kwargs.get("worker_extension_cls"):  # vLLM mixes the extension into its worker class
            module, _, name = kwargs["worker_extension_cls"].rpartition(".")
            ext = getattr(importlib.import_module(module), name)
            self.worker = type("FakeWorker", (ext,), {})()
            self.worker.model_runner = types.SimpleNamespace(model=self)
        FakeLLM.instances.append(self)

    def generate(self, requests, sampling_params, use_tqdm=False):
        per_request = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(requests)
        self.calls.append(per_request)
        self.events.append("generate")
        outs = []
        for req, sampling_params in zip(requests, per_request):
            completions = []
            for j in range(sampling_params.n):
                # token k of sample j: (first prompt token + 10 j + k) % 50, logprob -(k + 1) / 10
                toks = [(req["prompt_token_ids"][0] + 10 * j + k) % 50 for k in range(sampling_params.max_tokens)]
                lps = [{t: _Logprob(-(k + 1) / 10)} for k, t in enumerate(toks)]
                completions.append(types.SimpleNamespace(token_ids=toks, logprobs=lps, finish_reason="length"))
            outs.append(types.SimpleNamespace(outputs=completions))
        return outs

    def apply_model(self, func):
        _cross_process(func)
        return [func(self)]

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        _cross_process((method, args, kwargs))
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    def load_weights(self, weights):
        self.loaded.append({name: t.clone() for name, t in weights})
        self.events.append("load_weights")

    def sleep(self, level=1):
        self.calls.append(("sleep", level))
        self.events.append("sleep")

    def wake_up(self):
        self.calls.append("wake_up")
        self.events.append("wake_up")


def _cross_process(obj) -> None:
    """Raise as vLLM V1's serializer does for what cannot cross to the worker processes without pickle."""
    if isinstance(obj, (str, bytes, int, float, bool, type(None))):
        return
    if isinstance(obj, (list, tuple)):
        for item in obj:
            _cross_process(item)
        return
    if isinstance(obj, dict):
        for key, value in obj.items():
            _cross_process(key)
            _cross_process(value)
        return
    raise TypeError(f"Object of type {type(obj)} is not serializable")


def install(monkeypatch) -> types.ModuleType:
    """Put the stand-in at sys.modules["vllm"] (undone by monkeypatch) and clear FakeLLM.instances."""
    module = types.ModuleType("vllm")
    module.LLM = FakeLLM
    module.SamplingParams = lambda **kw: types.SimpleNamespace(**kw)
    monkeypatch.setitem(sys.modules, "vllm", module)
    FakeLLM.instances.clear()
    return module
