"""The seam between an agent and an engine that decodes its replies elsewhere (vLLM): what is asked and answered.

`agents.remote.generate_with` runs an agent whole (JSON repairs, tools, reviews) with every reply decoded by a
`ReplyDecoder`; this module holds only the request, the reply and the protocol, so both sides read one
definition without importing each other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:
    from agents.spec import GenerationSettings

__all__ = ["DecodeRequest", "DecodedReply", "ReplyDecoder"]


@dataclass(frozen=True)
class DecodeRequest:
    """One reply to decode: the prompt, how, and under what grammar."""

    agent: str
    prompt_ids: list[int]
    """The document prefix's ids, then the agent's suffix (its instructions, upstream outputs, repair turns)."""
    prefix_tokens: int
    """How many of `prompt_ids` are the document prefix (the part an engine's cache may hold)."""
    max_new_tokens: int
    settings: GenerationSettings
    schema: dict[str, object] | None
    """The JSON schema the reply must match, laid out with a 2-space indent (None: free text)."""
    stop: tuple[str, ...] = ()
    """Strings that end the reply (not part of it): the agent's, and for free text the document's markers."""
    grounded: bool = False
    """The schema's list items are the document's sentences, which this process keeps distinct (an engine
    without that filter lets the model repeat one; the repeats are dropped after decoding)."""
    attempt: int = 0
    cancelled: Callable[[], bool] = field(default=lambda: False)


@dataclass(frozen=True)
class DecodedReply:
    text: str
    finish_reason: Literal["eos", "stop", "length"]
    token_ids: list[int]
    not_applied: tuple[str, ...] = ()
    """The request's settings the engine could not apply, each with why (``"no_repeat_ngram_size: ..."``)."""
    stopped_by: str | None = None
    """The stop string that ended the reply, if one did."""


class ReplyDecoder(Protocol):
    """Decodes replies somewhere other than this process (an engine's server)."""

    def decode(self, request: DecodeRequest, on_piece: Callable[[str, int, int], None]) -> DecodedReply:
        """Decode the reply; call ``on_piece(text, token_id, index)`` for each token as it comes (``text`` may
        be ''), in order; stop early once ``request.cancelled()`` is true. Raise on a failed request."""
