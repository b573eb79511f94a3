"""Sessions: one document held on a pipeline's members for many runs (long-document chat in Python).

    with pipeline.session(document, name="contract") as s:
        s.ask("Who may terminate it?")          # the pipeline's `question` input; the last agent's answer
        s.run_sync(inputs={"question": "..."})  # the whole report

While a session is open the document's caches (source and every agent's member: exact or mapped) are
leased, so no budget evicts them between runs: each run computes only its agents' own tokens. A document
longer than a window is held chunk by chunk, cut once for questions of up to `input_tokens` tokens. A named
session is kept in the home (``sessions/<name>.json``: the document and what was asked), and
`Pipeline.session(name=...)` reopens it later, in this process or another; the disk tier then brings the
document's caches back without a prefill.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from agents.bridge import run_blocking
from orchestra.documents.chunking import HOLD_INPUT_TOKENS
from orchestra.errors import SessionError

if TYPE_CHECKING:
    from orchestra.familycache import CacheLease
    from orchestra.observability.report import RunReport
    from orchestra.pipelines.spec import PipelineSpec
    from orchestra.runs.scheduler import Orchestra

__all__ = ["Session", "SessionPipeline", "session_path"]

class SessionPipeline(Protocol):
    """What a session needs of `orchestra.Pipeline` (a structural type: the builder imports this module)."""

    @property
    def spec(self) -> PipelineSpec: ...

    def orchestra(self) -> Orchestra: ...

    async def run(self, document: str, *, inputs: Mapping[str, object] | None = None, run_id: str | None = None,
                  resume: bool = False) -> RunReport: ...


_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def session_path(home: Path, name: str) -> Path:
    """Where a named session lives in a home."""
    if not _NAME.match(name):
        raise SessionError(f"session name {name!r}: use letters, digits, '.', '_' and '-' (at most 128)")
    return home / "sessions" / f"{name}.json"


class Session:
    """A document held on its pipeline's members for many runs; use it as a (sync or async) context manager."""

    def __init__(self, pipeline: SessionPipeline, document: str, *, name: str | None = None,
                 path: Path | None = None, history: list[dict[str, object]] | None = None,
                 input_tokens: int = HOLD_INPUT_TOKENS) -> None:
        self.pipeline = pipeline
        self.document = document
        self.input_tokens = input_tokens
        """Room kept per input value (the question) when a document longer than a window is cut into chunks."""
        self.name = name
        self.path = path
        self.history: list[dict[str, object]] = list(history or [])
        """What was asked and answered: one record per run (run id, inputs, each agent's status and output)."""
        self.reports: list[RunReport] = []
        """This process's runs in the session, in order."""
        self._leases: list[CacheLease] = []
        self._open = False

    # -- holding the document -----------------------------------------------------------------------------------
    @property
    def held(self) -> list[CacheLease]:
        """The leases holding the document's caches while the session is open (where each came from: disk,
        memory, computed)."""
        return list(self._leases)

    async def open(self) -> Session:
        """Obtain and hold the document's caches (what entering the context does)."""
        if not self._open:
            self._leases = await self.pipeline.orchestra().hold(self.document, input_tokens=self.input_tokens)
            self._open = True
            self._save()
        return self

    def close(self) -> None:
        """Let the document's caches go (they stay cached until the budget needs the room)."""
        if self._open:
            self.pipeline.orchestra().unhold(self.document, self._leases)
        self._leases = []
        self._open = False

    async def __aenter__(self) -> Session:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def __enter__(self) -> Session:

        from orchestra.runs._loop import refuse_inside_event_loop

        refuse_inside_event_loop()
        return run_blocking(self.open)

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- runs -----------------------------------------------------------------------------------------------
    async def run(self, inputs: Mapping[str, object] | None = None, *, run_id: str | None = None) -> RunReport:
        """Run the pipeline over the session's document with these inputs (a `run_id` makes it durable, as in
        `Pipeline.run`)."""
        if not self._open:
            raise SessionError("the session is closed: open it (`with pipeline.session(...) as s:`) before running")
        report = await self.pipeline.run(self.document, inputs=inputs, run_id=run_id)
        self.reports.append(report)
        self.history.append({"run_id": report.run_id, "at": time.time(), "inputs": report.inputs,
                             "agents": {a.name: {"status": a.status, "output": a.output} for a in report.agents}})
        self._save()
        return report

    def run_sync(self, inputs: Mapping[str, object] | None = None, *, run_id: str | None = None) -> RunReport:
        """`run` for synchronous code."""
        import functools

        from orchestra.runs._loop import refuse_inside_event_loop

        refuse_inside_event_loop()
        return run_blocking(functools.partial(self.run, inputs, run_id=run_id))

    async def aask(self, question: str, **inputs: object) -> str:
        """Put `question` in the pipeline's question input (`question`, or its only input), run, and return the
        answer: the output of its last agent that nothing else reads."""
        report = await self.run({**inputs, self._question_input(): question})
        answer = report.agent(self._answering_agent())
        if answer.status != "succeeded" or answer.output is None:
            why = answer.error or answer.skip_reason or answer.degenerate_reason or answer.status
            raise SessionError(f"agent {answer.name!r} gave no answer ({answer.status}: {why}); see session.reports[-1]")
        return answer.output

    def ask(self, question: str, **inputs: object) -> str:
        """`aask` for synchronous code."""
        import functools

        from orchestra.runs._loop import refuse_inside_event_loop

        refuse_inside_event_loop()
        return run_blocking(functools.partial(self.aask, question, **inputs))

    def _question_input(self) -> str:
        declared = list(self.pipeline.spec.inputs)
        if "question" in declared:
            return "question"
        if len(declared) == 1:
            return declared[0]
        raise SessionError("ask() puts the question in the pipeline's `question` input: declare it "
                           f"(with_input('question') or `inputs: [question]`); it has {declared or 'none'}")

    def _answering_agent(self) -> str:
        upstreams = self.pipeline.spec.upstreams()
        read = {up for ups in upstreams.values() for up in ups}
        sinks = [a.name for a in self.pipeline.spec.agents if a.name not in read]
        return sinks[-1]

    def _save(self) -> None:
        if self.path is None:
            return
        from mappings.atomic import write_atomic

        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(self.path, json.dumps({"name": self.name, "pipeline": self.pipeline.spec.name,
                                            "document": self.document, "input_tokens": self.input_tokens,
                                            "history": self.history}))

    @classmethod
    def load(cls, pipeline: SessionPipeline, path: Path, name: str) -> Session:
        """Reopen a named session from its file (its document and history)."""
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            document = str(data["document"])
            history = list(data.get("history") or [])
            input_tokens = int(data.get("input_tokens", HOLD_INPUT_TOKENS))
        except FileNotFoundError:
            raise SessionError(f"no session named {name!r} in {path.parent}: open it once with its document "
                               f"(pipeline.session(document, name={name!r}))") from None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SessionError(f"session file {path} is unreadable ({exc}): delete it and open the session again "
                               "with its document") from exc
        return cls(pipeline, document, name=name, path=path, history=history, input_tokens=input_tokens)
