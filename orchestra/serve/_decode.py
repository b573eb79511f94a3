"""Decoding one reply over its prefix cache: where the member's model is (this process, or its Ray actor).

`decode` is the whole of it, wherever it runs: batched with the member's other replies when the cache
can be (`BatchDecoder`, one per model), alone otherwise, taking the model's lock per step either way.
`remote_decode_op` is the same thing as a streaming op for the ray executor: it runs in the member's
actor (so the batch decoder and the JSON constraint live beside the weights) and emits each token.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from agents.constrained import JsonConstraint, TokenConstraint
    from agents.continuation import Continuation, TokenStream
    from mappings.types import KVCache, Model, Tokenizer
    from orchestra.models.registry import LoadedModel
    from orchestra.serve._batch import BatchDecoder
    from orchestra.serve._sampling import SampledToken, SamplingSettings
    from orchestra.serve._schemas import ResponseFormat

__all__ = ["batch_stats_op", "decode", "json_constraint", "remote_decode_op"]

OnToken = Callable[[str, int, int, "SampledToken | None"], None]
"""Called for every generated token: its text (what became safe to stream, possibly ''), id, index, and its
log-probability when the reply reports them."""

_BATCHERS = threading.Lock()


def decode(loaded: LoadedModel, lock: threading.Lock, cache: KVCache, prefix_len: int, new_ids: list[int],
           settings: Mapping[str, object], cancel: threading.Event, *, on_token: OnToken | None,
           constraint: TokenConstraint | None,
           batcher: Callable[[], BatchDecoder] | None) -> Continuation:
    """The reply to `new_ids` after `prefix_len` cached positions; `batcher` gives the member's batch decoder
    (None: decode alone). `settings` are the reply's sampling ones (`SamplingSettings`)."""
    from agents.continuation import TokenStream
    from agents.runner import eos_token_ids
    from orchestra.serve._batch import batchable
    from orchestra.serve._sampling import ServeSampler

    sampling = cast("SamplingSettings", settings)  # the engine's own keys, not a client's dict
    sampler = ServeSampler.from_serve_settings(sampling)

    def token_done(text: str, token_id: int, index: int) -> None:
        if on_token is not None:
            on_token(text, token_id, index, sampler.last)

    stream = TokenStream(loaded.tokenizer, eos_token_ids(loaded.model, loaded.tokenizer),
                         max_new_tokens=sampling["max_new_tokens"], stop=sampling.get("stop", ()),
                         on_token=token_done, constraint=constraint, sampler=sampler)
    if batcher is not None and batchable(cache):
        from agents.kv import check_context

        check_context(loaded.model, prefix_len, len(new_ids), sampling["max_new_tokens"])
        return batcher().decode(cache, prefix_len, new_ids, stream, cancel)
    return _decode_alone(loaded.model, lock, cache, prefix_len, new_ids, stream, cancel)


def _decode_alone(model: Model, lock: threading.Lock, cache: KVCache | None, prefix_len: int, new_ids: list[int],
                  stream: TokenStream, cancel: threading.Event) -> Continuation:
    """One reply on its own: `agents.continuation.continue_stream` with the reply's `TokenStream` (its sampler)."""
    from agents.continuation import continue_stream

    return continue_stream(model, stream, cache, prefix_len, new_ids, cancel=cancel, lock=lock)


def json_constraint(tokenizer: Tokenizer, vocab_size: int, fmt: ResponseFormat | None) -> JsonConstraint | None:
    """The JSON constraint a response format asks for (None for text); a schema xgrammar refuses is a 400."""
    if fmt is None or fmt.type == "text":
        return None
    from agents.constrained import JsonConstraint
    from orchestra.serve._errors import BadRequest
    from orchestra.serve._tools import TOOL_REPLY

    schema = fmt.json_schema.schema_ if fmt.json_schema else None
    if schema is None:
        return JsonConstraint.for_tokenizer(tokenizer, None, vocab_size=vocab_size)
    from agents.schema import check_schema

    try:  # the schema itself first (jsonschema): a mistake in it is named where it is, not as a grammar error
        check_schema(schema)
    except ValueError as exc:
        raise BadRequest(f"response_format.json_schema.schema: {exc}", param="response_format") from None
    # a tool call (or answer) is the server's own JSON, parsed by it: laid out fixed, so it cannot be padded forever
    fixed = fmt.json_schema is not None and fmt.json_schema.name == TOOL_REPLY
    try:
        return JsonConstraint.for_tokenizer(tokenizer, schema, vocab_size=vocab_size, fixed_layout=fixed)
    except Exception as exc:  # xgrammar refuses the schema (RuntimeError, ValueError, ...)
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        reason = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", reason)[:300]  # xgrammar's "[time] file.cc:N: "
        raise BadRequest(f"response_format.json_schema.schema is not a JSON schema this server can follow: "
                         f"{reason}", param="response_format") from exc


def vocab_size(model: Model) -> int:
    """The model's logits width (it may pad the tokenizer's vocabulary)."""
    return int(model.get_output_embeddings().weight.shape[0])


def remote_decode_op(loaded: LoadedModel, cache: KVCache, prefix_len: int, new_ids: list[int],
                     settings: Mapping[str, object],
                     response_format: ResponseFormat | None, batch: bool, max_batch: int, *,
                     emit: Callable[[tuple[str, int, int, SampledToken | None]], None], cancel: threading.Event,
                     state: dict[str, object]) -> Continuation:
    """`decode` inside a member's Ray actor: each token is emitted as ``(text, token_id, index, logprob)``.

    The actor's one batch decoder (kept in its `state`) batches every reply running on it, whichever
    driver thread asked; the JSON constraint is compiled here, where its matcher is stepped.
    """
    constraint = json_constraint(loaded.tokenizer, vocab_size(loaded.model), response_format)

    def batcher() -> BatchDecoder:
        from orchestra.serve._batch import BatchDecoder

        with _BATCHERS:
            found = state.get("serve.batcher")
            if not isinstance(found, BatchDecoder):  # none yet
                found = state["serve.batcher"] = BatchDecoder(loaded, loaded.lock, max_batch=max_batch)
            return found

    return decode(loaded, loaded.lock, cache, prefix_len, new_ids, settings, cancel,
                  on_token=lambda text, token_id, index, logprob: emit((text, token_id, index, logprob)),
                  constraint=constraint,
                  batcher=batcher if batch else None)


def batch_stats_op(loaded: LoadedModel, *, emit: Callable[[object], object], cancel: threading.Event,
                   state: dict[str, object]) -> dict[str, int]:
    """The actor's batch decoder's counters (a streaming op that emits nothing): forward passes and rows in them."""
    from orchestra.serve._batch import BatchDecoder

    found = state.get("serve.batcher")
    found = found if isinstance(found, BatchDecoder) else None
    return {"steps": found.steps if found else 0, "rows_stepped": found.rows_stepped if found else 0}
