"""What a person sees while a pipeline runs: one line per event above a live table of the agents.

The scheduler also logs every event through structlog (`orchestra._logging`), for services that collect
logs, and the web view's server logs its requests. On a terminal a log line would print beside each event's
own, and Python's warnings would come with their source lines, so `quiet_library_output` configures
structlog to keep warnings and errors alone (orchestra's events follow an application's structlog
configuration) and turns Python's warnings into the CLI's own one-line form.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rich.console import Console, Group
from rich.live import Live
from rich.spinner import Spinner
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:
    from rich.console import RenderableType

    from orchestra.observability.events import AnyEvent

__all__ = ["RunDisplay", "quiet_library_output", "format_event"]


@contextlib.contextmanager
def quiet_library_output(console: Console, *, verbose: bool = False) -> Iterator[None]:
    """Inside: structlog below WARNING is dropped (``verbose`` keeps INFO) and warnings print as
    ``warning: message`` once each, through ``console``; both are restored on exit."""
    import structlog

    previous = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO if verbose else logging.WARNING))
    seen: set[str] = set()
    old_show = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001 - warnings' signature
        text = str(message)
        if text not in seen:  # a warning repeated per agent says nothing new the second time
            seen.add(text)
            console.print(f"[yellow]warning:[/] {text}", highlight=False, markup=True, soft_wrap=True)

    warnings.showwarning = show
    bars = _transformers_bars(False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")  # our dedupe replaces Python's per-location one
            warnings.showwarning = show
            yield
    finally:
        warnings.showwarning = old_show
        structlog.configure(**previous)
        _transformers_bars(bars)


def _transformers_bars(enabled: bool) -> bool:
    """Turn transformers' per-model "Loading weights" bars on or off; returns whether they were on."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    return was


def _secs(value: float) -> str:
    return f"{value:.2f} s" if value < 10 else f"{value:.1f} s"


def format_event(event: AnyEvent) -> str | None:
    """The one line an event prints as (None for token events: they advance the live table instead)."""
    if event.kind == "token":
        return None
    if event.kind == "run_started":
        return (f"run {event.run_id}: {len(event.agents)} agents over {event.document_tokens:,} document tokens, "
                f"source {event.source_model}")
    if event.kind == "document_prefilled":
        how = "reused from the cache" if event.store_hit else f"prefilled in {_secs(event.seconds)}"
        return f"document: {event.tokens:,} tokens on {event.model}, {how}"
    if event.kind == "cache_step":
        if event.agent is None:
            return None  # the run's own document prefill: its document_prefilled event says it
        s = event.step
        who = event.agent
        if s.step == "map":
            what = f"mapped {s.tokens:,} tokens {s.source} -> {s.member}"
        elif s.step == "prefill":
            what = f"prefilled {s.tokens:,} tokens on {s.member}" + (
                f" over {s.reused_tokens:,} cached" if s.reused_tokens else "")
        elif s.step == "hit":
            what = f"{s.reused_tokens:,} tokens cached on {s.member}"
        elif s.step == "repair":
            what = f"repaired {s.tokens:,} tokens on {s.member}"
        elif s.step == "join":
            what = f"joined a build in flight on {s.member}"
        elif s.step == "load" and s.tokens:
            what = f"read {s.tokens:,} {s.entry_kind or 'exact'} tokens from disk on {s.member}"
        else:
            what = f"{s.step} on {s.member}" + (f": {s.reason}" if s.reason else "")
        return f"{who}: {what}" + (f" ({_secs(s.seconds)})" if s.seconds >= 0.01 else "")
    if event.kind == "cache_ready":
        return None  # its content already came as cache steps; the table shows the path
    if event.kind == "gate":
        metrics = ", ".join(f"{k} {v:.3g}" for k, v in list(event.metrics.items())[:3])
        verdict = "passed" if event.passed else "FAILED"
        return f"{event.agent}: gate {verdict} on {event.model}" + (f" ({metrics})" if metrics else "") + (
            f": {event.reason}" if not event.passed and event.reason else "")
    if event.kind == "fallback":
        return f"{event.agent}: falls back to a re-prefill on {event.model}: {event.reason}"
    if event.kind == "agent_started":
        return f"{event.agent}: started on {event.model}"
    if event.kind == "agent_finished":
        return f"{event.agent}: finished"
    if event.kind == "agent_failed":
        return f"{event.agent}: FAILED ({event.error_type}: {event.error})"
    if event.kind == "agent_skipped":
        return f"{event.agent}: skipped ({event.reason})"
    if event.kind == "tool_call":
        return f"{event.agent}: calls {event.tool}({event.arguments})"
    if event.kind == "tool_result":
        return f"{event.agent}: {event.tool} {'returned' if event.ok else 'FAILED'} in {_secs(event.seconds)}"
    if event.kind == "agent_restored":
        return f"{event.agent}: kept from the run's checkpoint ({event.status})"
    if event.kind == "run_finished":
        return (f"run finished in {_secs(event.seconds)}: {len(event.succeeded)} succeeded, {len(event.failed)} failed, "
                f"{len(event.skipped)} skipped")
    detail = {k: v for k, v in event.model_dump().items() if k not in {"kind", "run_id", "at"}}
    return f"{event.kind}: {detail}"


@dataclass
class _Row:
    model: str
    state: str = "waiting"
    cache: str = "-"
    tokens: int = 0
    notes: list[str] = field(default_factory=list)


class RunDisplay:
    """An event sink for `Pipeline.stream` / `Orchestra.run(on_event=...)` that draws the run.

    Each event but tokens prints one line; a live table (agent, member, state, cache, tokens) sits
    below them while the run lasts and is gone when it ends, so a log or a pipe gets only the lines.
    """

    def __init__(self, console: Console, agents: list[tuple[str, str]], *, lines: bool = True) -> None:
        self.console = console
        self.lines = lines  # False: only the live table (`orchestra run` without --events)
        self.rows = {name: _Row(model) for name, model in agents}
        self._live: Live | None = None

    def __enter__(self) -> RunDisplay:
        if self.console.is_terminal:
            self._live = Live(self._render(), console=self.console, transient=True, refresh_per_second=8)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)
            self._live = None

    def __call__(self, event: AnyEvent) -> None:
        self._update(event)
        line = format_event(event) if self.lines else None
        if line is not None:
            self.console.print(Text(line), soft_wrap=True)
        if self._live is not None:
            self._live.update(self._render())

    def _update(self, event: AnyEvent) -> None:
        row = self.rows.get(getattr(event, "agent", None) or "")
        if row is None:
            return
        if event.kind == "token":
            row.state, row.tokens = "generating", event.index + 1
        elif event.kind == "agent_started":
            row.state = "getting its cache"
        elif event.kind == "cache_ready":
            row.cache = event.path
        elif event.kind == "fallback":
            row.cache = "reprefilled"
        elif event.kind == "agent_restored":
            row.state = "kept"
        elif event.kind in ("agent_finished", "agent_failed", "agent_skipped"):
            row.state = {"agent_finished": "done", "agent_failed": "failed", "agent_skipped": "skipped"}[event.kind]

    def _render(self) -> Group:
        table = Table(box=None, pad_edge=False)
        for col in ("agent", "member", "state", "cache", "tokens"):
            table.add_column(col, justify="right" if col == "tokens" else "left")
        for name, row in self.rows.items():
            state: RenderableType = row.state
            if row.state in ("getting its cache", "generating"):
                state = Spinner("dots", text=row.state)
            table.add_row(name, row.model, state, row.cache, str(row.tokens))
        return Group(Text(""), table)
