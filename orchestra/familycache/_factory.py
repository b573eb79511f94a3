"""One way to build an executor by name: a name -> class table, as vLLM's KV-connector factory keeps.

The scheduler, the server and the tests all call `make_executor`; an executor whose dependencies are
optional (Ray) is named by ``"module:Class"`` and imported only when asked for, so importing this
module (or `orchestra.familycache`) never loads Ray.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

from orchestra.errors import ExecutorError, ExecutorUnavailableError
from orchestra.familycache._executor import Executor, LocalExecutor

if TYPE_CHECKING:
    from orchestra.familycache._settings import ExecutorSpec
    from orchestra.models.registry import ModelRegistry

__all__ = ["EXECUTORS", "UnknownExecutorError", "executor_class", "make_executor"]

EXECUTORS: dict[str, type[Executor] | str] = {
    "local": LocalExecutor,
    "ray": "orchestra.familycache._ray:RayExecutor",
    "vllm": "orchestra.vllm.executor:VllmExecutor",
}
"""Executor kind -> its class, or ``"module:Class"`` imported on first use (an optional dependency)."""

_NEEDS = {"ray": "Ray", "vllm": "vLLM"}
"""Kind -> what it needs (its pip extra is named after the kind), for the error when it is missing."""


class UnknownExecutorError(ExecutorError, ValueError):
    """An executor kind that `make_executor` does not know; the message lists those it does."""


def executor_class(kind: str) -> type[Executor]:
    """The class `kind` names; `UnknownExecutorError` for a name not in `EXECUTORS`, `ExecutorUnavailableError`
    when its optional dependency is not installed."""
    try:
        target = EXECUTORS[kind]
    except KeyError:
        raise UnknownExecutorError(f"unknown executor kind {kind!r}; known kinds: {', '.join(sorted(EXECUTORS))}") \
            from None
    if not isinstance(target, str):
        return target
    module, _, name = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module), name)
    except ImportError as exc:
        from orchestra.errors import install_command

        raise ExecutorUnavailableError(f"the {kind} executor needs {_NEEDS.get(kind, module)} ({exc}): "
                                       f"{install_command(kind)}") from exc
    if not (isinstance(cls, type) and issubclass(cls, Executor)):
        raise ExecutorError(f"executor kind {kind!r} names {target}, which is not an Executor")
    return cls


def make_executor(kind: str, registry: ModelRegistry, spec: ExecutorSpec | None = None, *,
                  members: Sequence[str] | None = None, name: str = "pipeline", max_concurrency_per_device: int = 1,
                  start: bool = False) -> Executor:
    """The executor `kind` names over `registry`, configured by `spec` (a pipeline's or server's `executor:`).

    `members` are the aliases that need to run (a remote executor starts workers for those only), `name`
    labels what it starts. With `start`, it acquires its resources now (a ray one joins Ray, places and
    loads its actors) and is closed again if that fails, so a caller that answers "ready" can serve.
    """
    executor = executor_class(kind).from_spec(registry, spec, members=members, name=name,
                                              max_concurrency_per_device=max_concurrency_per_device)
    if start:
        try:
            executor.start()
        except BaseException:
            executor.close()
            raise
    return executor
