"""What a pipeline sent by someone else may make this process do, read from its raw data before it is built.

A server runs pipelines its clients send inline (``POST /v1/runs`` with ``spec``). Building a `PipelineSpec`
imports the Python it names, so the client's data is read first, as plain JSON, by `client_spec_reach`:

- every place it names Python (a step's ``call``, an agent's ``tools`` and ``output.model``, a ``when`` given
  as a reference rather than as a condition written as data);
- every setting that would point the server at a folder, a file or an address of the client's choosing
  (``mapping.directory``, ``kv_store.directory``, ``executor.address``, ``executor.vllm``'s engine arguments
  and store): a served run uses the server's own
  mapping store, disk tier and executor, so these are never the client's to set.

`check_client_spec` refuses the spec with `CodeNotAllowedError` (a server answers 403) when a reference is
outside the server's `CodePolicy` or any such setting is given; nothing has been imported at that point.
The server then builds the spec under the same policy (`agents.references.code_policy`), so a reference this
reading does not know of is still refused when something tries to import it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from agents.errors import CodeNotAllowedError
from agents.references import CodePolicy, colon_form

__all__ = ["ClientSpecReach", "CodeReference", "ServerSetting", "check_client_spec", "client_spec_reach"]

SERVER_SETTINGS = {
    ("mapping", "directory"): "the server's mapping store",
    ("kv_store", "directory"): "the server's disk tier (--kv-store)",
    ("executor", "address"): "the server's executor (--executor, --ray-address)",
    # engine arguments (a connector's module path among them) and a store folder: never a client's
    ("executor", "vllm"): "the server's executor (`orchestra serve --engine vllm` starts its own engines)",
}
"""Settings of a pipeline that name a place on (or reachable from) the server -> what a served run uses instead."""


@dataclass(frozen=True)
class CodeReference:
    """One place a pipeline names Python: where (``steps[0].call``), the reference text, and what it is for."""

    where: str
    reference: str
    what: str


@dataclass(frozen=True)
class ServerSetting:
    """One setting a pipeline gives that names a folder, file or address: where, and what a served run uses."""

    where: str
    value: object
    instead: str


@dataclass(frozen=True)
class ClientSpecReach:
    """Everything a pipeline's raw data would make the process import or touch, found without building it."""

    code: tuple[CodeReference, ...]
    settings: tuple[ServerSetting, ...]

    def refusals(self, policy: CodePolicy) -> list[str]:
        """One line per reference `policy` refuses and per server setting given (empty: the spec may be built)."""
        lines = [f"{ref.where}: {why}" for ref in self.code
                 if (why := _why_not(policy, ref)) is not None]
        lines += [f"{s.where}: a served pipeline uses {s.instead}, not a location the request names; remove "
                  f"{s.where}" for s in self.settings]
        return lines


def _why_not(policy: CodePolicy, ref: CodeReference) -> str | None:
    if ref.what == "condition":
        return ("a condition over HTTP is written as data, e.g. {agent: triage, equals: legal}, not as a reference "
                "to Python")
    return policy.refusal(ref.reference, ref.what)


def client_spec_reach(data: object) -> ClientSpecReach:
    """The Python references and server settings in a pipeline's raw data (as a pipeline file holds it).

    Reads any JSON value without failing. Only text can name Python (JSON carries no functions, and the
    fields that import read text), so parts of another type or shape are left to validation, which refuses
    them without importing anything.
    """
    if not isinstance(data, Mapping):
        return ClientSpecReach((), ())
    code = [*_agent_references(data.get("agents")), *_step_references(data.get("steps"))]
    settings = []
    for (section, key), instead in SERVER_SETTINGS.items():
        block = data.get(section)
        if isinstance(block, Mapping) and block.get(key) is not None:
            settings.append(ServerSetting(f"{section}.{key}", block[key], instead))
    return ClientSpecReach(tuple(code), tuple(settings))


def check_client_spec(data: object, policy: CodePolicy) -> None:
    """`CodeNotAllowedError` listing every reference `policy` refuses and every server setting the pipeline gives."""
    reach = client_spec_reach(data)
    lines = reach.refusals(policy)
    if lines:
        raise CodeNotAllowedError("the pipeline may not run here: " + "; ".join(lines),
                                  reference=next((ref.reference for ref in reach.code), ""))


def _items(value: object) -> Iterator[tuple[int, Mapping[str, object]]]:
    if isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, Mapping):
                yield i, item


def _step_references(steps: object) -> Iterator[CodeReference]:
    for i, step in _items(steps):
        call, when = step.get("call"), step.get("when")
        if isinstance(call, str):
            yield CodeReference(f"steps[{i}].call", call, "step")
        if isinstance(when, str):
            yield CodeReference(f"steps[{i}].when", when, "condition")


def _agent_references(agents: object) -> Iterator[CodeReference]:
    for i, agent in _items(agents):
        where = f"agents[{i}]"
        when = agent.get("when")
        if isinstance(when, str):
            yield CodeReference(f"{where}.when", when, "condition")
        spec = agent.get("spec")
        if not isinstance(spec, Mapping):
            continue
        tools = spec.get("tools")
        for j, tool in enumerate(tools if isinstance(tools, list) else [tools] if tools is not None else []):
            call = tool.get("call") if isinstance(tool, Mapping) else tool
            if isinstance(call, str):
                yield CodeReference(f"{where}.spec.tools[{j}]" + (".call" if isinstance(tool, Mapping) else ""),
                                    call, "tool")
        output = spec.get("output")
        model = output.get("model") if isinstance(output, Mapping) else None
        if isinstance(model, str):
            yield CodeReference(f"{where}.spec.output.model", colon_form(model), "output model")
