"""The agent DAG: validation (cycles, unknown upstreams), execution levels, mermaid drawing."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping, Sequence

import networkx as nx

from orchestra.errors import CycleError, UnknownAgentError

__all__ = ["build_graph", "levels", "to_mermaid", "descendants"]


def build_graph(upstreams: Mapping[str, Sequence[str]], models: Mapping[str, str] | None = None) -> nx.DiGraph:
    """Edges run upstream → agent. Raises UnknownAgentError or CycleError with the offending names."""
    graph = nx.DiGraph()
    for name in upstreams:
        graph.add_node(name, model=(models or {}).get(name))
    for name, ups in upstreams.items():
        for up in ups:
            if up not in upstreams:
                close = difflib.get_close_matches(up, list(upstreams), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise UnknownAgentError(
                    f"agent {name!r} reads upstream {up!r}, which is not an agent of this pipeline{hint}; "
                    f"known agents: {', '.join(sorted(upstreams))}"
                )
            if up == name:
                raise CycleError(f"agent {name!r} lists itself as upstream; remove it from its upstream list")
            graph.add_edge(up, name)
    try:
        cycle = nx.find_cycle(graph)
    except nx.NetworkXNoCycle:
        return graph
    path = " -> ".join([u for u, _ in cycle] + [cycle[0][0]])
    raise CycleError(f"the agents form a cycle: {path}; break it by removing one upstream reference")


def levels(graph: nx.DiGraph) -> list[list[str]]:
    """Agents grouped so every agent's upstreams are in earlier groups."""
    return [sorted(generation) for generation in nx.topological_generations(graph)]


def descendants(graph: nx.DiGraph, names: Iterable[str]) -> set[str]:
    out: set[str] = set()
    for name in names:
        out |= nx.descendants(graph, name)
    return out


def to_mermaid(graph: nx.DiGraph, source_model: str | None = None) -> str:
    """A mermaid flowchart: one node per agent labelled with its model, the shared document first."""
    def node_id(name: str) -> str:
        return "a_" + "".join(c if c.isalnum() else "_" for c in name)

    lines = ["flowchart TD", f'    doc[["document prefill on {source_model or "source"}"]]']
    for name in nx.topological_sort(graph):
        model = graph.nodes[name].get("model")
        label = f"{name}<br/><small>{model}</small>" if model else name
        lines.append(f'    {node_id(name)}["{label}"]')
        if graph.in_degree(name) == 0:
            lines.append(f"    doc --> {node_id(name)}")
    for up, down in graph.edges:
        lines.append(f"    {node_id(up)} --> {node_id(down)}")
    return "\n".join(lines) + "\n"

