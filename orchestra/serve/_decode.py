"""Decoding one reply over its prefix cache: where the member's model is (this process, or its Ray actor).

`decode` is the whole of it, wherever it runs: batched with the member's other replies when the cache
can be (`BatchDecoder`, one per model), alone otherwise, taking the model's lock per step either way.
`remote_decode_op` is the same thing as a streaming op for the ray executor: it runs in the member's
actor (so the batch decoder and the JSON constraint live beside the weights) and emits each token.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agents.continuation import Continuation
    from orchestra.registry import LoadedModel
    from orchestra.serve._batch import BatchDecoder
    from orchestra.serve._schemas import ResponseFormat

__all__ = ["batch_stats_op", "decode", "json_constraint", "remote_decode_op"]

OnToken = Callable[[str, int, int], None]

_BATCHERS = threading.Lock()


def decode(loaded: LoadedModel, lock: threading.Lock, cache: Any, prefix_len: int, new_ids: list[int],
           settings: dict[str, Any], cancel: threading.Event, *, on_token: OnToken | None, constraint: Any,
           batcher: Callable[[], BatchDecoder] | None) -> Continuation:
    """The reply to `new_ids` after `prefix_len` cached positions; `batcher` gives the member's batch decoder
    (None: decode alone). `settings` are the sampling ones (max_new_tokens, temperature, top_p, seed, stop)."""
    from agents.continuation import TokenStream, continue_ids
    from agents.runner import eos_token_ids
    from orchestra.serve._batch import batchable

    if batcher is not None and batchable(cache):
        from agents.kv import check_context

        check_context(loaded.model, prefix_len, len(new_ids), settings["max_new_tokens"])
        stream = TokenStream(loaded.tokenizer, eos_token_ids(loaded.model, loaded.tokenizer), on_token=on_token,
                             constraint=constraint, **settings)
        return batcher().decode(cache, prefix_len, new_ids, stream, cancel)
    return continue_ids(loaded.model, loaded.tokenizer, cache, prefix_len, new_ids, cancel=cancel, lock=lock,
                        on_token=on_token, constraint=constraint, **settings)


def json_constraint(tokenizer: Any, vocab_size: int, fmt: ResponseFormat | None) -> Any:
    """The JSON constraint a response format asks for (None for text); a schema xgrammar refuses is a 400."""
    if fmt is None or fmt.type == "text":
        return None
    from agents.constrained import JsonConstraint
    from orchestra.serve._errors import BadRequest

    schema = fmt.json_schema.schema_ if fmt.json_schema else None
    if schema is None:
        return JsonConstraint.for_tokenizer(tokenizer, None, vocab_size=vocab_size)
    try:
        return JsonConstraint.for_tokenizer(tokenizer, schema, vocab_size=vocab_size)
    except Exception as exc:  # xgrammar refuses the schema (RuntimeError, ValueError, ...)
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        reason = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", reason)[:300]  # xgrammar's "[time] file.cc:N: "
        raise BadRequest(f"response_format.json_schema.schema is not a JSON schema this server can follow: "
                         f"{reason}", param="response_format") from exc


def vocab_size(model: Any) -> int:
    """The model's logits width (it may pad the tokenizer's vocabulary)."""
    return int(model.get_output_embeddings().weight.shape[0])


def remote_decode_op(loaded: LoadedModel, cache: Any, prefix_len: int, new_ids: list[int], settings: dict[str, Any],
                     response_format: ResponseFormat | None, batch: bool, max_batch: int, *,
                     emit: Callable[[Any], None], cancel: threading.Event, state: dict[str, Any]) -> Continuation:
    """`decode` inside a member's Ray actor: each token is emitted as ``(text, token_id, index)``.

    The actor's one batch decoder (kept in its `state`) batches every reply running on it, whichever
    driver thread asked; the JSON constraint is compiled here, where its matcher is stepped.
    """
    constraint = json_constraint(loaded.tokenizer, vocab_size(loaded.model), response_format)

    def batcher() -> BatchDecoder:
        from orchestra.serve._batch import BatchDecoder

        with _BATCHERS:
            found = state.get("serve.batcher")
            if found is None:
                found = state["serve.batcher"] = BatchDecoder(loaded, loaded.lock, max_batch=max_batch)
            return found

    return decode(loaded, loaded.lock, cache, prefix_len, new_ids, settings, cancel,
                  on_token=lambda text, token_id, index: emit((text, token_id, index)), constraint=constraint,
                  batcher=batcher if batch else None)


def batch_stats_op(loaded: LoadedModel, *, emit: Callable[[Any], None], cancel: threading.Event,
                   state: dict[str, Any]) -> dict[str, int]:
    """The actor's batch decoder's counters (a streaming op that emits nothing): forward passes and rows in them."""
    found = state.get("serve.batcher")
    return {"steps": found.steps if found else 0, "rows_stepped": found.rows_stepped if found else 0}
