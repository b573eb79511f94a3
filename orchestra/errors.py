"""Typed errors raised by the orchestra package; each message says what to fix."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "install_command",
    "OrchestraError",
    "FamilyError",
    "GGUFUnavailableError",
    "CorruptGGUFError",
    "FamilyHomeError",
    "FamilyBuildError",
    "MemberNotFoundError",
    "PipelineError",
    "PipelineProblem",
    "PipelineValidationError",
    "PipelineFileError",
    "CycleError",
    "RunInputError",
    "UnknownAgentError",
    "UnknownModelError",
    "ModelReferenceError",
    "ModelFolderError",
    "ModelNotCachedError",
    "HubModelError",
    "AdapterError",
    "AdapterBaseError",
    "QuantizeError",
    "QuantizeBaseError",
    "CrossFamilyError",
    "DocumentError",
    "ChunkCallError",
    "DevicePlacementError",
    "MappingUnavailableError",
    "EventLoopRunningError",
    "OperationCancelledError",
    "InputFileError",
    "OutputError",
    "ExecutorError",
    "ExecutorUnavailableError",
    "ActorLostError",
]


class OrchestraError(Exception):
    """Base class of every error orchestra raises on purpose."""


class FamilyError(OrchestraError):
    """Something is wrong with the model family or its home directory."""


class GGUFUnavailableError(FamilyError):
    """The SmolLM2 GGUF could not be found locally nor downloaded."""


class CorruptGGUFError(FamilyError):
    """The GGUF file exists but cannot be parsed (truncated or not a GGUF)."""


class FamilyHomeError(FamilyError):
    """The family home directory cannot be used (not a directory, not writable)."""


class FamilyBuildError(FamilyError):
    """Building a family member failed; nothing half-written was left behind."""


class MemberNotFoundError(FamilyError):
    """A family member was asked for that is not built or not known."""


class PipelineError(OrchestraError):
    """A pipeline definition is invalid; raised before any model loads."""


@dataclass(frozen=True)
class PipelineProblem:
    """One thing wrong with a pipeline definition, located well enough to fix it without a traceback."""

    message: str
    """What is wrong and what to do about it."""
    field: str | None = None
    """The field, relative to the agent when there is one (``args.max_words``, ``spec.task``, ``upstream``),
    else relative to the pipeline (``models``, ``gate.probe.tokens``)."""
    agent: str | None = None
    """The agent's name, when the problem is inside one agent."""
    location: str | None = None
    """The full dotted path in the pipeline document (``agents.1.args.max_words``), when it says more than
    the field does (it locates the agent in a file by position)."""

    def describe(self) -> str:
        where = []
        if self.agent is not None:
            where.append(f"agent {self.agent!r}")
        if self.field:
            shown = f"field {self.field}"
            if self.location and self.location != self.field:
                shown += f" ({self.location})"
            where.append(shown)
        elif self.location:
            where.append(self.location)
        return (", ".join(where) + ": " if where else "") + self.message


class PipelineValidationError(PipelineError, ValueError):
    """A pipeline definition does not validate; raised when the PipelineSpec (or an agent) is built.

    ``problems`` lists every problem found (agent, field, message); ``path`` is the pipeline file, if any.
    One problem reads as one line, so a command line prints it as one line. It is also a ValueError,
    so code written against the pydantic models' ValidationError keeps catching it.
    """

    def __init__(self, message: str | None = None, *, problems: Iterable[PipelineProblem] = (),
                 path: str | Path | None = None) -> None:
        self.problems: tuple[PipelineProblem, ...] = tuple(problems)
        self.path: Path | None = Path(path) if path is not None else None
        if message is None:
            message = _describe(self.problems)
        if self.path is not None and not message.startswith(str(self.path)):
            message = f"{self.path}: {message}"
        super().__init__(message)

    def with_path(self, path: str | Path) -> PipelineFileError:
        """The same problems, attributed to a pipeline file."""
        return PipelineFileError(problems=self.problems, path=path) if self.problems else PipelineFileError(
            str(self), path=path)


def _describe(problems: tuple[PipelineProblem, ...]) -> str:
    if not problems:
        return "the pipeline does not validate"
    if len(problems) == 1:
        return problems[0].describe()
    lines = [f"the pipeline does not validate ({len(problems)} problems):"]
    lines += [f"  - {p.describe()}" for p in problems]
    return "\n".join(lines)


class PipelineFileError(PipelineValidationError):
    """A pipeline file cannot be read, parsed or validated; names the file, the agent, the field and the fix."""


class CycleError(PipelineError):
    """The agents' upstream references form a cycle."""


class UnknownAgentError(PipelineError):
    """An agent name that does not exist: an upstream an agent reads, or one asked of a pipeline or a run report."""


class UnknownModelError(PipelineError):
    """An agent or the source names a model that is not in the pipeline's family."""


class ModelReferenceError(UnknownModelError):
    """A model reference (a local folder, or a Hugging Face Hub id ``org/name[@revision]``) cannot be used."""


class ModelFolderError(ModelReferenceError):
    """A model folder (or a Hub snapshot) lacks config.json or ``*.safetensors`` weights (the only ones loaded)."""


class ModelNotCachedError(ModelReferenceError):
    """A Hub model is not in the Hugging Face cache and cannot be downloaded now (offline, or no connection)."""


class HubModelError(ModelReferenceError):
    """The Hub refuses a model: no such repository or revision, gated, private, or another HTTP error."""


class AdapterError(ModelReferenceError):
    """A LoRA adapter cannot be a member: files missing, or a peft feature the runtime does not apply."""


class AdapterBaseError(AdapterError):
    """An adapter's base is not a declared (plain) model of the pipeline, so there are no weights to put it on."""


class QuantizeError(ModelReferenceError):
    """A quantized view of a member cannot be made: an unknown scheme, or one the device (or torchao) cannot run."""


class QuantizeBaseError(QuantizeError):
    """A quantized view's base is not a declared plain model of the pipeline, so there are no weights to quantize."""


class CrossFamilyError(PipelineError):
    """A model is not from the pipeline's family (different tokenizer), so its KV cannot be shared."""


class DocumentError(OrchestraError):
    """The document cannot be processed (empty, or longer than a model allows)."""


class ChunkCallError(OrchestraError):
    """One call of a chunked agent (over one chunk of the document, or of a reduce round's notes) failed."""


class DevicePlacementError(OrchestraError):
    """A model does not fit on the device chosen for it, or the device does not exist."""


class MappingUnavailableError(OrchestraError):
    """No mapping exists for a (source, target) pair and the pipeline forbids calibrating one."""


class EventLoopRunningError(OrchestraError, RuntimeError):
    """A synchronous entry point (``Pipeline.run_sync``) was called where an event loop is already running.

    Blocking there would stall every other task on that loop (a web server's requests, for one), and
    a second loop cannot start inside the first; the async API is the way in from async code.
    """


class OperationCancelledError(OrchestraError):
    """Work was cancelled (Ctrl-C, a timeout) before it finished; nothing half-done was saved."""


class RunInputError(PipelineError, ValueError):
    """A run's inputs do not match the pipeline's declared ``inputs``: one missing, unknown, or malformed."""


class RunResumeError(PipelineError, ValueError):
    """A run to resume does not exist, or was started with another pipeline, document or inputs."""


class SessionError(OrchestraError):
    """A session cannot do what was asked: no such named session, no input to put a question in, an answer
    that did not come (its agent failed), or a session used after it was closed."""


class DocumentFormatError(DocumentError):
    """A document file cannot be read in its format: an encrypted or damaged PDF, a scan without text, an HTML
    page without main text, or the format's library not installed."""


class InputFileError(DocumentError):
    """A document, corpus or other input file cannot be read as text: missing, binary, or in another encoding."""


class OutputError(OrchestraError):
    """A report or other output cannot be written (no space left, no permission, not a file path)."""


class ExecutorError(OrchestraError):
    """The executor that runs model work (docs/scale-out.md) cannot do what was asked."""


class ExecutorUnavailableError(ExecutorError):
    """The executor cannot start: Ray is not installed, the cluster is unreachable, or it cannot place the actors."""


class ActorLostError(ExecutorError):
    """A Ray actor holding a family member died while it ran this work; it restarts, and the next run uses it.

    ``actor`` names the actor (``alias#replica``), ``node`` the node it ran on, ``op`` the work it was doing.
    """

    def __init__(self, message: str, *, actor: str = "", node: str = "", op: str = "") -> None:
        super().__init__(message)
        self.actor, self.node, self.op = actor, node, op

    def __reduce__(self):  # keeps the fields when it crosses processes
        return (_actor_lost, (str(self), self.actor, self.node, self.op))


def _actor_lost(message: str, actor: str, node: str, op: str) -> ActorLostError:
    return ActorLostError(message, actor=actor, node=node, op=op)


def install_command(extra: str) -> str:
    """The pip command that adds the optional dependencies `extra` to this installation of orchestra.

    The distribution is installed from a clone (``pip install -e .``) as often as from an index, and
    ``pip install 'orchestra-kv[extra]'`` only works for the latter, so the command names the clone when pip
    recorded one (PEP 610's ``direct_url.json``).
    """
    import json
    from importlib import metadata
    from urllib.parse import unquote, urlparse

    origin: dict = {}
    for dist in metadata.distributions(name="orchestra-kv"):  # a source tree's egg-info may come first
        recorded = dist.read_text("direct_url.json")
        if recorded:
            try:
                origin = json.loads(recorded)
            except ValueError:
                continue
            break
    url = urlparse(str(origin.get("url", "")))
    if url.scheme == "file" and "dir_info" in origin:
        folder = unquote(url.path)
        editable = "-e " if origin["dir_info"].get("editable") else ""
        return f"pip install {editable}'{folder}[{extra}]'"
    return f"pip install 'orchestra-kv[{extra}]'"
