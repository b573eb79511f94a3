"""Agents whose replies an engine decodes (vLLM): the `ReplyDecoder` seam and `generate_with`.

An agent is more than one decode: a JSON agent parses, validates, reviews and repairs its reply; a tool
agent runs calls between rounds; every agent is checked for degenerate output. `generate_with` runs all of
that exactly as `agents.runner.generate` does, with each attempt's tokens coming from a `ReplyDecoder`
instead of forward passes in this process. The decoder receives the whole prompt as token ids (the
document prefix, whose cache the engine holds or loads, then the agent's suffix), the schema a grammar
must hold the reply to, and the budget; it streams pieces of text back and says which of the agent's
settings it could not apply, which the result lists in ``not_applied``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, cast

from agents.decoding import DecodedReply, DecodeRequest, ReplyDecoder

if TYPE_CHECKING:
    import threading

    from agents.runner import AgentResult, TokenEvent
    from agents.spec import AgentSpec
    from mappings.types import Tokenizer

__all__ = ["DecodeRequest", "DecodedReply", "ReplyDecoder", "generate_with"]


def generate_with(decoder: ReplyDecoder, tokenizer: Tokenizer, spec: AgentSpec, *, prefix_ids: Sequence[int],
                  upstream: Mapping[str, object] | None = None, on_token: Callable[[TokenEvent], None] | None = None,
                  cancel: Callable[[], bool] | threading.Event | None = None, limit: int | None = None,
                  use_chat_template: bool | None = None) -> AgentResult:
    """Run ``spec`` after the document prefix ``prefix_ids`` with every reply decoded by ``decoder``: the same
    repairs, tool rounds, reviews and result as `agents.runner.generate`. ``limit``: the model's positions."""
    from agents.prompt import document_span
    from agents.runner import _agent_result, _as_check, _Attempts, _Clock, _run_agent

    clock = _Clock(start=time.perf_counter())
    prefix = list(prefix_ids)
    if not prefix:
        raise ValueError("prefix_ids is empty; build it with DocumentPrompt(...).token_ids(tokenizer)")
    document = (document_span(cast(str, tokenizer.decode(prefix))) if spec.output.kind == "json" and spec.output.grounded
                else None)
    attempts = _Attempts(model=None, tokenizer=tokenizer, spec=spec, prefix_ids=prefix, prefix_cache=None,
                         upstream=upstream, use_chat_template=use_chat_template,
                         eos=frozenset(), on_token=on_token, cancelled=_as_check(cancel),
                         clock=clock, lock=None, document=document, decoder=decoder, limit=limit)
    outcome = _run_agent(attempts)
    return _agent_result(spec, outcome, clock, len(prefix), reprefilled=False, not_applied=attempts.not_applied)
