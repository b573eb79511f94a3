"""Tools an agent may call: plain Python functions, their JSON schema derived from type hints and docstrings.

    @tool
    def find(text: str, document: str) -> str:
        \"\"\"The passages of the document that contain `text`.\"\"\"

    spec = AgentSpec(name="qa", task="Answer: who may copy it?", tools=[find], max_tool_rounds=3)

Each round the agent replies under a grammar of ``{"tool": <name>, "arguments": {...}} | {"answer": "..."}``
(so even a small model writes a valid call of a known tool); a call's arguments are validated by pydantic,
the function runs with a timeout (`run_tool` says what becomes of one that overruns it), and its result (or
its error, as text) is appended to the agent's continuation as a new turn over the same cached document prefix.
A parameter named ``document`` is not the model's to fill: it receives the document the agent reads. After
`max_tool_rounds` calls the agent must answer.
"""

from __future__ import annotations

import inspect
import json
import re
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, get_type_hints

import anyio
from pydantic import (
    BaseModel,
    ConfigDict,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    create_model,
    model_validator,
)

from agents.bridge import run_blocking, start_thread
from agents.errors import AgentError
from agents.references import import_reference

__all__ = ["Tool", "ToolCall", "ToolSchemaError", "ToolWorkers", "tool", "find", "round_schema", "round_instructions",
           "run_tool", "answer_text", "bound_strings", "INJECTED", "OVERRUN_TOOLS"]

MAX_ARGUMENT_CHARS = 80
"""Longest string argument a call's grammar allows (unless the tool's own schema says otherwise)."""

INJECTED = ("document",)
"""Parameters a tool receives from the run, not from the model."""

CANCEL_GRACE_S = 1.0
"""How long past its deadline `run_tool` waits for a cancelled async tool's thread to end before it treats the
tool as one that cannot be cancelled (a coroutine that blocks its event loop, or shields itself)."""


class ToolSchemaError(AgentError, ValueError):
    """A function cannot be a tool: a parameter without a type hint, or a type with no JSON schema."""


class Tool(BaseModel):
    """A function an agent may call, with the JSON schema of its arguments."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)
    name: str
    description: str
    call: str
    """'module:function', or '<python>' for a function given directly."""
    parameters: dict[str, object]
    """JSON schema of the arguments the model fills (`INJECTED` ones left out)."""
    timeout_s: float = 10.0

    _fn: Callable[..., Any] | None = PrivateAttr(None)
    _args: type[BaseModel] | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _imported(self, info: ValidationInfo) -> Tool:
        """A tool named by its path is imported when it is built (as a pipeline's steps are), so a wrong path, or
        one the code policy refuses, is found while the spec is validated, never when the agent first calls it
        in some worker thread. `Tool.of` hands over the function it has already imported."""
        given = info.context.get("function") if isinstance(info.context, dict) else None
        if given is not None:
            self._fn, self._args = given
        elif self.call != "<python>" and self._fn is None:
            fn = _import(self.call)
            self._fn, self._args = fn, _arguments_model(fn)
        return self

    @classmethod
    def of(cls, fn: Callable[..., Any] | str, *, name: str | None = None, timeout_s: float = 10.0) -> Tool:
        """A tool of a function (or of its 'module:function' path)."""
        call = "<python>"
        if isinstance(fn, str):
            call = fn
            fn = _import(fn)
        if isinstance(fn, Tool):
            return fn
        args = _arguments_model(fn)
        doc = inspect.getdoc(fn) or ""
        return cls.model_validate(
            {"name": name or fn.__name__, "description": doc.split("\n\n")[0].replace("\n", " ").strip(),
             "call": call, "parameters": args.model_json_schema(), "timeout_s": timeout_s},
            context={"function": (fn, args)})

    def function(self) -> Callable[..., Any]:
        if self._fn is None:
            fresh = Tool.of(self.call, name=self.name, timeout_s=self.timeout_s)
            self._fn, self._args = fresh._fn, fresh._args
        assert self._fn is not None
        return self._fn

    def validate_arguments(self, arguments: object) -> dict[str, object]:
        """The model's arguments checked against the schema (ValueError saying what is wrong)."""
        self.function()
        assert self._args is not None
        if not isinstance(arguments, Mapping):
            raise ValueError("arguments must be a JSON object")
        try:
            return self._args.model_validate(dict(arguments)).model_dump()
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ())) or "arguments"
            raise ValueError(f"{where}: {first.get('msg')}") from exc


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None,
         timeout_s: float = 10.0) -> Any:
    """Mark a function as a tool (``@tool`` or ``@tool(timeout_s=5)``): it becomes a `Tool` agents take."""
    if fn is None:
        return lambda f: Tool.of(f, name=name, timeout_s=timeout_s)
    return Tool.of(fn, name=name, timeout_s=timeout_s)


@dataclass(frozen=True)
class ToolCall:
    """One call an agent made: what it asked, what came back, how long it took."""

    name: str
    arguments: dict[str, object]
    result: str
    ok: bool
    seconds: float
    round: int

    def as_dict(self) -> dict[str, object]:
        return {"name": self.name, "arguments": self.arguments, "result": self.result, "ok": self.ok,
                "seconds": self.seconds, "round": self.round}


def round_schema(tools: list[Tool], *, may_call: bool = True, must_call: bool = False) -> dict[str, object]:
    """The grammar of one round: a call of one of the tools or the final answer; only the answer when not
    `may_call`, only a call when `must_call`."""
    answer = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
              "additionalProperties": False}
    if not may_call:
        return answer
    calls = [{"type": "object", "properties": {"tool": {"const": t.name}, "arguments": _plain(t.parameters)},
              "required": ["tool", "arguments"], "additionalProperties": False} for t in tools]
    return {"anyOf": calls} if must_call else {"anyOf": [*calls, answer]}


def answer_text(reply: str) -> str:
    """The answer of a round's reply: its ``answer`` field, also from a reply cut off inside it."""
    import json as _json

    match = re.search(r'"answer"\s*:\s*"((?:[^"\\]|\\.)*)', reply, re.DOTALL)
    if match is None:
        return reply.strip()
    try:
        return str(_json.loads('"' + match.group(1) + '"')).strip()
    except ValueError:  # cut inside an escape
        return match.group(1).strip()


def round_instructions(tools: list[Tool], *, may_call: bool = True) -> str:
    """What the agent is told about its tools each round."""
    if not may_call:
        return 'Now give your final answer as a JSON object: {"answer": "..."}.'
    lines = ["You may call a tool to look something up before answering. Tools:"]
    for t in tools:
        props = t.parameters.get("properties")
        args = ", ".join(f"{k}: {v.get('type', 'value')}" for k, v in props.items()
                         if isinstance(v, dict)) if isinstance(props, dict) else ""
        lines.append(f"- {t.name}({args}): {t.description}")
    lines.append('Reply with one JSON object: {"tool": "<name>", "arguments": {...}} to call a tool, or '
                 '{"answer": "..."} when you can answer.')
    return "\n".join(lines)


class ToolWorkers:
    """The threads of tool calls that overran their timeout and could not be cancelled, kept until they end.

    Python cannot interrupt a running sync function, so a sync tool that overruns keeps its thread until it
    returns; its result is then discarded. Those threads are not abandoned: each is handed to a `ToolWorkers`,
    and whoever owns the run joins it when the run ends::

        with ToolWorkers() as workers:           # leaving the block joins every overrunning tool's thread
            call = run_tool(tools, name, arguments, document=doc, round=0, workers=workers)

    The threads are daemon threads all the same, so a tool that never returns cannot keep the interpreter
    from exiting.
    """

    def __init__(self) -> None:
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def track(self, thread: threading.Thread) -> None:
        """Keep `thread` (a started one) until it is joined."""
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)

    def alive(self) -> list[threading.Thread]:
        """The tracked threads still running."""
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            return list(self._threads)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for every tracked thread to end (at most `timeout` seconds in all): True when none is left."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in self.alive():
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not self.alive()

    def __enter__(self) -> ToolWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.join()


OVERRUN_TOOLS = ToolWorkers()
"""Where `run_tool` keeps an overrunning sync tool's thread when its caller gives no `workers` of its own."""


def run_tool(tools: list[Tool], name: str, arguments: object, *, document: str, round: int,
             workers: ToolWorkers | None = None) -> ToolCall:
    """Call a tool by name with the model's arguments: its result, or its error as text (never raised).

    The tool runs in a thread of its own, for at most its `timeout_s`; when that passes the agent gets
    ``error: <name> did not answer within <timeout_s> s``, and no thread is left behind unaccounted:

    - an async tool (one whose call returns an awaitable) runs in an event loop of its thread under a cancel
      scope whose deadline is the call's; at the deadline the scope is cancelled, and the thread is joined
      before `run_tool` returns, so nothing of the tool runs after it (a tool that catches the cancellation
      and returns anyway still gets the timeout error; its value is discarded);
    - a sync tool cannot be interrupted: `run_tool` returns the timeout error at the deadline, the function
      runs on to its end in its thread and its result is discarded, and the thread is handed to `workers`
      (`OVERRUN_TOOLS` when none is given), which the owner of the run joins when the run ends. An async tool
      whose thread has not ended `CANCEL_GRACE_S` after its cancellation (it blocks its event loop, or shields
      itself from cancellation) is handled the same way.
    """
    t0 = time.perf_counter()
    call = _prepared(tools, name, arguments, document=document, round=round, started=t0)
    if isinstance(call, ToolCall):
        return call
    outcome: dict[str, object] = {}
    in_loop = threading.Event()  # the call returned an awaitable: a cancel scope bounds it
    worker = start_thread(call.run, name=f"tool-{name}", args=(outcome, in_loop))
    worker.join(call.timeout)
    if worker.is_alive() and in_loop.is_set():
        worker.join(CANCEL_GRACE_S)  # its scope is cancelled at the deadline: the thread ends right after
    return _recorded(call, outcome, worker, workers)


@dataclass(frozen=True)
class _Invocation:
    """A validated call about to run: the tool's function, the model's and the injected arguments, its deadline."""

    name: str
    fn: Callable[..., object]
    args: dict[str, object]
    injected: dict[str, object]
    timeout: float
    started: float
    """When `run_tool` was called (`time.perf_counter`): the deadline is `timeout` seconds after it."""
    round: int

    def run(self, outcome: dict[str, object], in_loop: threading.Event) -> None:
        """Call the function (in the call's thread), setting ``in_loop`` when it returns an awaitable; its value,
        its error as text, or that it timed out goes into ``outcome``."""
        try:
            value = self.fn(**self.args, **self.injected)
            if inspect.isawaitable(value):
                in_loop.set()
                value = _await_until(value, self.timeout - (time.perf_counter() - self.started), outcome)
            outcome["value"] = value
        except Exception as exc:  # the agent reads the error; the run goes on
            outcome["error"] = f"{type(exc).__name__}: {exc}"


def _prepared(tools: list[Tool], name: str, arguments: object, *, document: str, round: int,
              started: float) -> _Invocation | ToolCall:
    """The call, ready to run; or the ToolCall of its error (an unknown tool, bad arguments)."""
    found = next((t for t in tools if t.name == name), None)
    if found is None:
        return ToolCall(name, {}, f"error: there is no tool {name!r}; tools: {', '.join(t.name for t in tools)}",
                        False, 0.0, round)
    try:
        args = found.validate_arguments(arguments)
    except ValueError as exc:
        return ToolCall(name, dict(arguments) if isinstance(arguments, Mapping) else {},
                        f"error: bad arguments ({exc})", False, time.perf_counter() - started, round)
    fn = found.function()
    params = inspect.signature(fn).parameters
    return _Invocation(name=name, fn=fn, args=args, injected={k: document for k in INJECTED if k in params},
                       timeout=found.timeout_s, started=started, round=round)


def _await_until(awaitable: Awaitable[object], remaining: float, outcome: dict[str, object]) -> object:
    """Await ``awaitable`` in an event loop of this thread for at most ``remaining`` seconds: its result, or None
    (and ``outcome["timed_out"]``) when the deadline cancelled it."""

    async def bounded() -> object:
        with anyio.move_on_after(max(0.0, remaining)) as scope:
            result = await awaitable
        if scope.cancel_called:  # cancelled at the deadline (or it returned only after it)
            outcome["timed_out"] = True
            return None
        return result

    return run_blocking(bounded)


def _recorded(call: _Invocation, outcome: dict[str, object], worker: threading.Thread,
              workers: ToolWorkers | None) -> ToolCall:
    """The ToolCall of a call whose thread was joined up to its deadline; a thread still running is tracked."""
    seconds = time.perf_counter() - call.started
    name, args, round = call.name, call.args, call.round
    if worker.is_alive() or outcome.get("timed_out"):
        if worker.is_alive():  # it cannot be cancelled: it runs on, its result discarded, its thread tracked
            (OVERRUN_TOOLS if workers is None else workers).track(worker)
        return ToolCall(name, args, f"error: {name} did not answer within {call.timeout:g} s", False, seconds, round)
    if "error" in outcome:
        return ToolCall(name, args, f"error: {outcome['error']}", False, seconds, round)
    value = outcome.get("value")
    text = value if isinstance(value, str) else json.dumps(value, default=str, ensure_ascii=False)
    return ToolCall(name, args, text, True, seconds, round)


# -- schema ---------------------------------------------------------------------------------------------------------
def _arguments_model(fn: Callable[..., Any]) -> type[BaseModel]:
    """A pydantic model of the parameters the model fills (every one needs a type hint)."""
    try:
        hints = get_type_hints(fn)
    except Exception as exc:  # an annotation that does not resolve
        raise ToolSchemaError(f"tool {getattr(fn, '__name__', fn)!r}: its type hints do not resolve ({exc})") from exc
    fields: dict[str, Any] = {}
    for param in inspect.signature(fn).parameters.values():
        if param.name in INJECTED:
            continue
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ToolSchemaError(f"tool {fn.__name__!r}: *{param.name} cannot be described to a model; name each "
                                  "parameter")
        if param.name not in hints:
            raise ToolSchemaError(f"tool {fn.__name__!r}: parameter {param.name!r} has no type hint; annotate it "
                                  "(e.g. `text: str`) so its JSON schema can be derived")
        fields[param.name] = (hints[param.name], ... if param.default is param.empty else param.default)
    try:
        model = create_model(f"{fn.__name__}_arguments", **fields)
        model.model_json_schema()
    except Exception as exc:  # a type with no JSON schema
        raise ToolSchemaError(f"tool {fn.__name__!r}: its parameters have no JSON schema ({exc}); use JSON types "
                              "(str, int, float, bool, lists, dicts, pydantic models)") from exc
    return model


def _plain(schema: dict[str, object]) -> dict[str, object]:
    """The arguments' schema without titles (fewer tokens in the grammar), closed to unknown keys, strings bounded."""
    out = {k: v for k, v in schema.items() if k not in ("title", "description")}
    props = out.get("properties")
    if isinstance(props, dict):
        out["properties"] = {k: {kk: vv for kk, vv in v.items() if kk != "title"} if isinstance(v, dict) else v
                             for k, v in props.items()}
    out["additionalProperties"] = False
    return bound_strings(out, MAX_ARGUMENT_CHARS)


def bound_strings(schema: dict[str, object], limit: int) -> dict[str, object]:
    """`schema` with every string (in properties and items, at any depth) at most `limit` characters unless it
    sets its own maxLength: a small model otherwise writes one until its token budget ends, and the call is cut
    off."""
    out = dict(schema)
    if out.get("type") == "string" and "maxLength" not in out:
        out["maxLength"] = limit
    props = out.get("properties")
    if isinstance(props, dict):
        out["properties"] = {k: bound_strings(v, limit) if isinstance(v, dict) else v for k, v in props.items()}
    items = out.get("items")
    if isinstance(items, dict):
        out["items"] = bound_strings(items, limit)
    return out


def _import(path: str) -> Callable[..., Any]:
    try:
        fn = import_reference(path, what="tool", origin=lambda found: found.function() if isinstance(found, Tool)
                              else found)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ToolSchemaError(f"cannot import tool {path!r} ({exc}); give it as 'module:function'") from exc
    if isinstance(fn, Tool):
        return fn.function()
    if not callable(fn):
        raise ToolSchemaError(f"tool {path!r} is not callable")
    return fn


@tool
def find(text: str, document: str) -> str:
    """The passages of the document that contain the text (at most three, case ignored)."""
    needle = " ".join(text.lower().split())
    if not needle:
        return "give some words to look for"
    passages = [p.strip() for p in re.split(r"\n\s*\n", document) if p.strip()]
    hits = [p for p in passages if needle in " ".join(p.lower().split())]
    if not hits:
        return f"no passage contains {text!r}"
    return "\n\n".join(p if len(p) <= 600 else p[:600] + " ..." for p in hits[:3])
