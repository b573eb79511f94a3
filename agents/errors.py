"""Typed errors raised by the agents package; each message says what went wrong and what to fix."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "AgentError",
    "InvalidTemplateError",
    "UnknownUpstreamError",
    "EmptyDocumentError",
    "ContextOverflowError",
    "PrefixCacheMismatchError",
    "GenerationCancelledError",
    "AgentOutputError",
    "OutputValidationError",
    "TruncatedOutputError",
    "MissingDependencyError",
    "CodeNotAllowedError",
]


class AgentError(Exception):
    """Base class of every error the agents package raises on purpose."""

    def __reduce__(self):  # pickles with its fields whatever its __init__ takes (errors cross processes)
        return (_rebuild, (type(self), self.args, dict(self.__dict__)))


def _rebuild(cls: type[AgentError], args: tuple, state: dict) -> AgentError:
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(state)
    return error


class InvalidTemplateError(AgentError, ValueError):
    """An agent's task template cannot be parsed or uses a placeholder form that is not supported."""


class UnknownUpstreamError(AgentError):
    """A task template references upstream outputs that were not provided."""

    def __init__(self, agent: str, missing: Iterable[str], available: Iterable[str]) -> None:
        self.agent = agent
        self.missing = tuple(missing)
        self.available = tuple(sorted(available))
        names = ", ".join(repr(m) for m in self.missing)
        have = ", ".join(repr(a) for a in self.available) or "none"
        super().__init__(
            f"agent {agent!r}: its task template references upstream output(s) {names} that were not "
            f"provided (available: {have}); fix the name in the template or run that agent upstream"
        )


class EmptyDocumentError(AgentError, ValueError):
    """The document is empty (or only whitespace): there is nothing to analyse."""


class ContextOverflowError(AgentError):
    """Document + agent suffix + max_new_tokens do not fit in the model's maximum positions."""

    def __init__(
        self,
        *,
        limit: int,
        prefix_tokens: int,
        suffix_tokens: int = 0,
        max_new_tokens: int = 0,
        agent: str | None = None,
    ) -> None:
        self.limit = limit
        self.prefix_tokens = prefix_tokens
        self.suffix_tokens = suffix_tokens
        self.max_new_tokens = max_new_tokens
        self.agent = agent
        self.needed = prefix_tokens + suffix_tokens + max_new_tokens
        self.over_by = self.needed - limit
        who = f"agent {agent!r}: " if agent else ""
        super().__init__(
            f"{who}document ({prefix_tokens} tokens) + agent prompt ({suffix_tokens}) + max_new_tokens "
            f"({max_new_tokens}) = {self.needed} tokens, {self.over_by} more than the model's maximum of "
            f"{limit} positions; shorten the document or lower max_new_tokens"
        )


class PrefixCacheMismatchError(AgentError):
    """The prefix cache does not hold exactly the prefix tokens it is claimed to hold."""

    def __init__(self, cache_tokens: int, prefix_tokens: int) -> None:
        self.cache_tokens = cache_tokens
        self.prefix_tokens = prefix_tokens
        super().__init__(
            f"the prefix cache holds {cache_tokens} tokens but the prefix has {prefix_tokens}; pass the "
            f"cache that was prefilled from exactly these prefix ids"
        )


class GenerationCancelledError(AgentError):
    """Generation was cancelled between two tokens."""

    def __init__(self, agent: str, tokens_generated: int) -> None:
        self.agent = agent
        self.tokens_generated = tokens_generated
        super().__init__(f"agent {agent!r}: generation cancelled after {tokens_generated} tokens")


class AgentOutputError(AgentError):
    """The agent's output could not be turned into the declared output kind."""

    def __init__(self, message: str, *, agent: str, raw_output: str, attempts: int) -> None:
        self.agent = agent
        self.raw_output = raw_output
        self.attempts = attempts
        super().__init__(message)


class OutputValidationError(AgentOutputError):
    """After all repair attempts the output still is not a JSON object that validates."""

    def __init__(self, *, agent: str, raw_output: str, error: str, attempts: int) -> None:
        self.error = error
        shown = raw_output if len(raw_output) <= 400 else raw_output[:400] + "..."
        super().__init__(
            f"agent {agent!r}: output is not valid after {attempts} attempt(s): {error}; last raw output: "
            f"{shown!r}. Simplify the schema, raise max_repairs, or use a stronger model",
            agent=agent,
            raw_output=raw_output,
            attempts=attempts,
        )


class TruncatedOutputError(AgentOutputError):
    """Generation hit max_new_tokens inside an unfinished JSON object (after all repair attempts)."""

    def __init__(self, *, agent: str, raw_output: str, max_new_tokens: int, attempts: int) -> None:
        self.max_new_tokens = max_new_tokens
        super().__init__(
            f"agent {agent!r}: output stopped at max_new_tokens={max_new_tokens} inside an unfinished JSON "
            f"object ({attempts} attempt(s)); raise generation.max_new_tokens or ask for a shorter object",
            agent=agent,
            raw_output=raw_output,
            attempts=attempts,
        )


class MissingDependencyError(AgentError, ImportError):
    """A library an agent needs is not installed; the message names the package and the pip command.

    Raised instead of quietly running without it: a JSON agent decoded without its grammar writes
    other replies (truncated or malformed objects), which is a different agent, not a slower one.
    """


class CodeNotAllowedError(AgentError):
    """A reference to Python ('module:function') that the code policy in force refuses (a server's request
    naming a module its operator did not allow); nothing was imported. Not a ValueError: validation passes it
    on unchanged, so a server answers it as a refusal (403), not as a malformed request."""

    def __init__(self, message: str, *, reference: str = "") -> None:
        super().__init__(message)
        self.reference = reference
