"""OpenRLHF agent files (`--train.agent_func_path`, `--agent_func_path`) loaded without OpenRLHF installed.

An OpenRLHF agent file imports `AgentInstanceBase` and `MultiTurnAgentExecutor` from `openrlhf.utils.agent` and
defines `class AgentExecutor(MultiTurnAgentExecutor)` around its `AgentInstance` (OpenRLHF 0.10+: `AgentExecutor()`
calls `super().__init__(AgentInstance)`; 0.8.x: `AgentExecutor(max_steps, max_length, llm_engine, hf_tokenizer,
result_queue)` calls `super().__init__(AgentInstance, max_steps, ...)`). OpenRLHF's executor then drives one fresh
instance per prompt: `reset({"observation", "label"})`, and `step({"observation_text", "action_text", "label",
"sampling_params"})` after each generated action, until `done` or the token budget is spent; the episode's reward
is the sum of the steps' `rewards` (`openrlhf/utils/agent.py`, 2fbe8cbc to 3c3be623).

tiller's environment loop (`tiller.rollout.environments`) runs the same protocol with its own engine, so only the
instance class is needed. When `openrlhf` cannot be imported, `openrlhf.utils.agent` resolves (while the file is
imported) to the three base classes below, which keep what the file's classes need: the executor records its
instance class. An executor that overrides `execute` (OpenRLHF's fully custom token-level executors) is refused:
tiller does not run the user's generation loop.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import types
from abc import ABC, abstractmethod

from tiller.errors import ConfigError
from tiller.stand_ins import installed, package


class AgentInstanceBase(ABC):
    """OpenRLHF's `openrlhf.utils.agent.AgentInstanceBase`: one environment per episode."""

    @abstractmethod
    def __init__(self, *args, **kwargs):
        pass

    async def reset(self, states: dict, **kwargs):
        return states

    @abstractmethod
    async def step(self, state_dict: dict, **kwargs):
        raise NotImplementedError("AgentInstance.step is not implemented")


class AgentExecutorBase(ABC):
    """OpenRLHF's executor base: tiller's stand-in records the instance class (both versions' constructors)."""

    def __init__(self, agent_instance_cls=None, *args, **kwargs):
        self.agent_instance_cls = agent_instance_cls

    async def execute(self, *args, **kwargs):
        raise NotImplementedError("tiller drives the AgentInstance with its own loop (tiller.rollout.environments)")


class MultiTurnAgentExecutor(AgentExecutorBase):
    """OpenRLHF's multi-turn executor around an `AgentInstanceBase` subclass."""


SHIM_CLASSES = (AgentInstanceBase, AgentExecutorBase, MultiTurnAgentExecutor)


def _real_module():
    try:
        return importlib.import_module("openrlhf.utils.agent")
    except Exception:  # noqa: BLE001 - OpenRLHF absent (or broken): the stand-in serves the import
        return None


@contextlib.contextmanager
def openrlhf_agent_imports():
    """While importing a user's agent file: `openrlhf.utils.agent` is OpenRLHF's own module when it imports,
    else a module holding the classes above (removed again afterwards; the file's classes keep their bases)."""
    agent = types.ModuleType("openrlhf.utils.agent")
    for cls in SHIM_CLASSES:
        setattr(agent, cls.__name__, cls)
    modules = {"openrlhf": package("openrlhf"), "openrlhf.utils": package("openrlhf.utils"),
               "openrlhf.utils.agent": agent}
    with installed(modules, skip=_real_module() is not None):
        yield


def _executor_bases() -> tuple[type, ...]:
    real = _real_module()
    found = [getattr(real, n, None) for n in ("AgentExecutorBase", "MultiTurnAgentExecutor")] if real else []
    return tuple(c for c in found if isinstance(c, type)) + (AgentExecutorBase, MultiTurnAgentExecutor)


def is_openrlhf_executor(obj) -> bool:
    return isinstance(obj, type) and issubclass(obj, _executor_bases())


def instance_class(executor_cls: type, where: str) -> type:
    """The AgentInstance class an OpenRLHF `AgentExecutor` wraps (its constructor run with OpenRLHF's arguments of
    0.10+, none, or of 0.8.x, all None). `where` names the file in errors."""
    bases = _executor_bases()
    for klass in executor_cls.__mro__:
        if klass in bases:
            break
        if "execute" in vars(klass):
            raise ConfigError(f"{where}: {klass.__name__} overrides execute() (a custom token-level executor): tiller "
                              "drives the AgentInstance's reset / step with its own loop, as OpenRLHF's "
                              "MultiTurnAgentExecutor does, and does not run a custom execute(); subclass "
                              "MultiTurnAgentExecutor without overriding execute")
    n_args = len(inspect.signature(executor_cls.__init__).parameters) - 1
    errors = []
    for args in ((), (None,) * 5, (None,) * max(n_args, 0)):
        try:
            executor = executor_cls(*args)
        except Exception as err:  # noqa: BLE001 - try the other version's constructor
            errors.append(f"{type(err).__name__}: {err}")
            continue
        cls = getattr(executor, "agent_instance_cls", None)
        if isinstance(cls, type):
            return cls
        errors.append("it recorded no agent_instance_cls")
    raise ConfigError(f"{where}: cannot find the AgentInstance class of {executor_cls.__name__} (constructed as "
                      f"OpenRLHF does: {'; '.join(dict.fromkeys(errors))})")
