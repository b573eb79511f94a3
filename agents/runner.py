"""Running one agent on one model over a document's prefix cache (the synchronous core).

`generate` copies the prefix cache (the caller's cache is never modified, so one document cache can
serve many agents, even concurrently), prefills the agent's suffix on the copy, then decodes token by
token: greedy or seeded sampling, stop strings, EOS, a callback per token, cancellation between
tokens. With ``prefix_cache=None`` it re-prefills prefix + suffix in one pass instead: the baseline that
cache reuse is measured against, and the fallback when no trustworthy cache exists.
JSON agents decode under a grammar of their schema (`agents.constrained`, xgrammar) and go through the
bounded repair loop of `agents.structured` for what a grammar cannot check (validation, degenerate
content, grounding). Text replies are checked by `agents.degenerate`; a degenerate one is returned with
``degenerate`` set so that the caller (the scheduler) never passes it downstream as an answer.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal, cast

import torch
from pydantic import BaseModel, ConfigDict, Field

from agents.continuation import TokenStream, eos_token_ids
from agents.degenerate import Degeneracy, check_text
from agents.errors import GenerationCancelledError
from agents.grounding import Grounding
from agents.kv import check_context, check_prefix_cache, forward_tokens, max_positions
from agents.prompt import FRAME_ECHOES, RepairTurn, Suffix, build_suffix, document_span
from agents.sampling import Sampler
from agents.spec import AgentSpec, OutputSpec
from agents.structured import JsonObjectTracker, extract_json_object, run_with_repairs
from agents.tools import ToolCall, ToolWorkers, answer_text, round_instructions, round_schema, run_tool
from mappings.cache_io import copy_cache, model_device, new_cache, sync_device

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from agents.constrained import TokenConstraint
    from agents.decoding import ReplyDecoder
    from mappings.types import CacheLike, Model, Tokenizer

__all__ = ["TokenEvent", "AgentTimings", "AgentResult", "FinishReason", "generate", "eos_token_ids"]

FinishReason = Literal["eos", "stop", "length"]


@dataclass(frozen=True)
class TokenEvent:
    """One generated token: the text it made safe to stream ('' if held back), its id and position."""

    agent: str
    text: str
    token_id: int
    index: int
    attempt: int = 0
    """0 for the first generation, n for the n-th JSON repair attempt (its tokens restart at index 0)."""


class AgentTimings(BaseModel):
    """Where one agent run spent its time (seconds; summed over repair attempts)."""

    model_config = ConfigDict(frozen=True)

    cache_copy_s: float
    """Copying the prefix cache (0 when re-prefilling)."""
    prefill_s: float
    """Suffix prefill over the cache, or the full prefix + suffix prefill when re-prefilling."""
    time_to_first_token_s: float
    """From the call to the first sampled token (includes copy and prefill)."""
    generation_s: float
    """Decoding after the prefill, all tokens."""
    total_s: float
    """Wall time of the whole call."""
    tokens_per_s: float
    """Generated tokens / generation_s."""


class AgentResult(BaseModel):
    """What one agent produced and what it cost."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    agent: str
    """The agent's name."""
    text: str
    """Output text (cut before a stop string; the raw reply for JSON agents)."""
    parsed: object = None
    """For JSON agents: the validated object (a pydantic model instance, or a dict for schemas)."""
    token_ids: list[int]
    """Generated token ids of the accepted attempt (including a final EOS)."""
    finish_reason: FinishReason
    """eos: end-of-sequence token; stop: a stop string or a complete JSON object; length: max_new_tokens."""
    attempts: int = 1
    """Generations it took (1 + JSON repairs)."""
    generated_tokens: int
    """Tokens generated over all attempts."""
    prefix_tokens: int
    """Length of the shared document prefix."""
    suffix_tokens: int
    """Length of the agent's suffix (accepted attempt)."""
    reprefilled: bool
    """True when no prefix cache was given and the whole prompt was prefilled."""
    timings: AgentTimings
    constrained: bool = False
    """True when a JSON grammar (xgrammar) constrained the accepted attempt's tokens."""
    degenerate: Degeneracy | None = None
    """Why the output is degenerate (empty, whitespace, a loop, a copied example); None for a real answer."""
    grounding: Grounding | None = None
    """For grounded JSON agents: how many items are verbatim spans of the document; ungrounded ones were dropped."""
    tool_calls: list[ToolCall] = Field(default_factory=list)
    """Agents with tools: each call it made, its result and seconds, in order."""
    duplicates_removed: int = 0
    """JSON agents: list items dropped from the reply as repeats of an earlier item."""
    not_applied: list[str] = Field(default_factory=list)
    """Settings the engine that decoded the reply could not apply (vLLM has no n-gram ban, say), each with why."""

    def downstream_text(self) -> str:
        """What downstream agents see: canonical JSON for JSON agents, the text otherwise."""
        if isinstance(self.parsed, BaseModel):
            return self.parsed.model_dump_json()
        if self.parsed is not None:
            import json

            return json.dumps(self.parsed, ensure_ascii=False)
        return self._whole_text()

    def _whole_text(self) -> str:
        """Free text; cut at max_new_tokens, up to its last complete sentence (`agents.finish`)."""
        if self.finish_reason != "length" or self.tool_calls:
            return self.text
        from agents.finish import complete_text

        return complete_text(self.text)

    def output_text(self) -> str:
        """What the agent's report and events show: a JSON agent's accepted value in the layout it was written in
        (2-space indent), so the items dropped from the reply (repeats, ungrounded or unfinished ones) are not
        shown as its answer; free text cut at max_new_tokens up to its last complete sentence; a degenerate
        reply as it was decoded."""
        if self.degenerate is not None:
            return self.text
        if self.parsed is None:
            return self._whole_text()
        import json

        value = self.parsed.model_dump(mode="json") if isinstance(self.parsed, BaseModel) else self.parsed
        return json.dumps(value, ensure_ascii=False, indent=2)


CancelCheck = Callable[[], bool]


def _as_check(cancel: CancelCheck | threading.Event | None) -> CancelCheck:
    if cancel is None:
        return lambda: False
    if isinstance(cancel, threading.Event):
        return cancel.is_set
    return cancel


@dataclass
class _Clock:
    start: float
    copy_s: float = 0.0
    prefill_s: float = 0.0
    generation_s: float = 0.0
    first_token_s: float | None = None
    generated: int = 0

    def timings(self) -> AgentTimings:
        """What the run took, up to now."""
        total = time.perf_counter() - self.start
        return AgentTimings(
            cache_copy_s=self.copy_s,
            prefill_s=self.prefill_s,
            time_to_first_token_s=self.first_token_s if self.first_token_s is not None else total,
            generation_s=self.generation_s,
            total_s=total,
            tokens_per_s=self.generated / self.generation_s if self.generation_s > 0 else 0.0,
        )


@dataclass
class _Generation:
    text: str
    finish_reason: FinishReason
    token_ids: list[int] = field(default_factory=list)
    suffix: Suffix | None = None
    constrained: bool = False


def bounded_schema(spec: AgentSpec, document: str | None = None) -> dict[str, object] | None:
    """The schema a JSON agent's grammar holds its reply to: its output's, with every list bounded by
    ``max_items`` and, for a grounded agent with the ``document`` given, list items limited to its sentences.

    The output's own schema object when nothing changes; None for free text or an unconstrained reply."""
    output = spec.output
    if output.kind != "json" or not output.constrained:
        return None
    schema = output.schema_dict()
    if schema is None or not (output.grounded and document is not None or output.max_items is not None):
        return schema
    from agents.grounding import grounded_schema

    limited = grounded_schema(schema, document if output.grounded else None, max_items=output.max_items)
    return limited if limited is not None else schema


def _json_constraint(model: Model, tokenizer: Tokenizer, spec: AgentSpec,
                     document: str | None = None) -> TokenConstraint | None:
    """A fresh grammar constraint for a JSON agent's reply, or None (free text, or a tokenizer xgrammar cannot read).

    For grounded agents with the ``document`` given, list items are limited to its sentences first.
    """
    output = spec.output
    if output.kind != "json" or not output.constrained:
        return None
    from agents.constrained import JsonConstraint, require_grammar

    require_grammar()  # without it the agent would decode unconstrained: another agent, not a slower one

    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None) or None
    schema = output.schema_dict()
    if schema is not None:
        limited = bounded_schema(spec, document)
        if limited is not schema:
            try:
                grammar = JsonConstraint.for_tokenizer(tokenizer, limited, vocab_size=vocab, fixed_layout=True)
            except Exception:  # noqa: BLE001 - too large for the grammar: the schema alone, checked after decoding
                pass
            else:
                if output.grounded and document is not None:
                    from agents.distinct import DistinctItems
                    from agents.grounding import document_sentences

                    return DistinctItems(grammar, tokenizer, document_sentences(document))
                return grammar
    try:
        return JsonConstraint.for_tokenizer(tokenizer, schema, vocab_size=vocab, fixed_layout=True)
    except Exception:  # noqa: BLE001 - a schema feature xgrammar cannot compile: any JSON object, then the tracker
        try:
            return JsonConstraint.for_tokenizer(tokenizer, None, vocab_size=vocab, fixed_layout=True)
        except Exception:  # noqa: BLE001 - a tokenizer xgrammar cannot read: unconstrained + repair loop
            return None


def _decode_once(
    model: Model,
    tokenizer: Tokenizer,
    spec: AgentSpec,
    prefix_ids: list[int],
    prefix_cache: CacheLike | None,
    suffix: Suffix,
    *,
    attempt: int,
    eos: frozenset[int],
    on_token: Callable[[TokenEvent], None] | None,
    cancelled: CancelCheck,
    clock: _Clock,
    lock: AbstractContextManager[object] | None = None,
    document: str | None = None,
) -> _Generation:
    """Decode one reply of ``spec`` to ``suffix`` over the prefix (a copy of its cache, or re-prefilled)."""
    settings = spec.generation
    n_prefix = len(prefix_ids)
    _check_attempt(model, spec, n_prefix, suffix, cancelled)
    device = model_device(model)
    constraint = _json_constraint(model, tokenizer, spec, document)
    tracker = JsonObjectTracker() if spec.output.kind == "json" and constraint is None else None

    # a free-text reply also ends where it starts writing the document markers (JSON and calls have their grammar);
    # repair attempts of a seeded agent draw with seed + attempt: a retry must not replay the rejected reply
    frame = FRAME_ECHOES if constraint is None and tracker is None else ()
    budget = reply_budget(max_positions(model), tokenizer, spec, n_prefix + len(suffix.ids), document)
    stream = TokenStream(tokenizer, eos, max_new_tokens=budget, stop=(*settings.stop, *frame),
                         on_token=_emitter(spec.name, attempt, on_token, clock), constraint=constraint,
                         sampler=Sampler.from_settings(settings, seed_offset=attempt),
                         ends=tracker.feed if tracker is not None else None)

    passes = _Passes(model=model, held=lock if lock is not None else contextlib.nullcontext(), clock=clock,
                     cancelled=cancelled, agent=spec.name)
    cache, logits, prefilled = _prefill(passes, prefix_ids, prefix_cache, suffix, device)
    _decode_tokens(passes, stream, cache, logits, n_prefix + len(suffix.ids), since=prefilled)
    return _finished(stream, frame, suffix, constrained=constraint is not None)


def reply_budget(limit: int | None, tokenizer: Tokenizer, spec: AgentSpec, prompt_tokens: int,
                 document: str | None) -> int:
    """``max_new_tokens``, raised for a grounded JSON agent to what its longest allowed reply needs (within the
    model's ``limit`` of positions), so that its JSON finishes: a reply cut mid-list loses the rest of its items."""
    settings, output = spec.generation, spec.output
    schema = output.schema_dict() if output.kind == "json" else None
    if schema is None or not output.grounded or document is None or output.max_items is None:
        return settings.max_new_tokens
    from agents.grounding import grounded_reply_tokens

    needed = grounded_reply_tokens(tokenizer, schema, document, output.max_items)
    room = limit - prompt_tokens if limit is not None else needed
    return max(settings.max_new_tokens, min(needed, room))


def _check_attempt(model: Model, spec: AgentSpec, n_prefix: int, suffix: Suffix, cancelled: CancelCheck) -> None:
    """Refuse an attempt before any compute: one that cannot fit the context, has no task, or is cancelled."""
    check_context(model, n_prefix, len(suffix.ids), spec.generation.max_new_tokens, agent=spec.name)
    if not suffix.ids:
        raise ValueError(f"agent {spec.name!r}: the suffix is empty; an agent needs a task")
    if cancelled():
        raise GenerationCancelledError(spec.name, 0)


def _emitter(agent: str, attempt: int, on_token: Callable[[TokenEvent], None] | None,
             clock: _Clock) -> Callable[[str, int, int], None]:
    """The stream's per-token callback: times the first token, counts every one, hands each on as a TokenEvent."""

    def emit(text: str, token: int, index: int) -> None:
        if clock.first_token_s is None:
            clock.first_token_s = time.perf_counter() - clock.start
        clock.generated += 1
        if on_token is not None:
            on_token(TokenEvent(agent=agent, text=text, token_id=token, index=index, attempt=attempt))

    return emit


@dataclass(frozen=True)
class _Passes:
    """How one attempt runs its forward passes: on which model, under which lock, timed and cancelled how."""

    model: Model
    held: AbstractContextManager[object]
    clock: _Clock
    cancelled: CancelCheck
    agent: str


def _prefill(passes: _Passes, prefix_ids: list[int], prefix_cache: CacheLike | None, suffix: Suffix,
             device: torch.device) -> tuple[CacheLike, torch.Tensor, float]:
    """Prefill the suffix over a copy of the prefix cache (or the whole prompt over a new cache).

    Returns the attempt's private cache, the logits of the last prompt position and when the prefill ended;
    the copy and the prefill are added to the clock.
    """
    model = passes.model
    cache: CacheLike
    t0 = time.perf_counter()
    with passes.held:
        if prefix_cache is None:
            cache = new_cache(model)
            t1 = t0
            logits = forward_tokens(model, [*prefix_ids, *suffix.ids], cache, 0)
        else:
            cache = copy_cache(prefix_cache, model)
            t1 = time.perf_counter()
            logits = forward_tokens(model, list(suffix.ids), cache, len(prefix_ids))
        sync_device(device)
    t2 = time.perf_counter()
    passes.clock.copy_s += t1 - t0
    passes.clock.prefill_s += t2 - t1
    return cache, logits, t2


def _decode_tokens(passes: _Passes, stream: TokenStream, cache: CacheLike, logits: torch.Tensor, position: int, *,
                   since: float) -> None:
    """Feed each chosen token back until ``stream`` finishes; GenerationCancelledError when cancelled between tokens.

    The decoding time from ``since`` is added to the clock, also when cancelled.
    """
    clock = passes.clock
    while True:
        token = stream.push(logits)
        if stream.finish is not None:
            break
        if passes.cancelled():
            clock.generation_s += time.perf_counter() - since
            raise GenerationCancelledError(passes.agent, len(stream.ids))
        with passes.held:  # per step, so agents sharing a model interleave their tokens
            logits = forward_tokens(passes.model, [token], cache, position)
        position += 1
    clock.generation_s += time.perf_counter() - since


def _finished(stream: TokenStream, frame: tuple[str, ...], suffix: Suffix, *, constrained: bool) -> _Generation:
    """The attempt's generation once ``stream`` has finished."""
    finish: FinishReason = stream.finish if stream.finish in ("eos", "stop", "length") else "length"
    text = stream.assembler.text
    if frame and stream.assembler.stopped_by in frame:
        text = text.rstrip(" \t\n#=*-")  # the heading or rule the marker came under
    return _Generation(text=text, finish_reason=finish, token_ids=list(stream.ids), suffix=suffix,
                       constrained=constrained)


def generate(
    model: Model,
    tokenizer: Tokenizer,
    spec: AgentSpec,
    *,
    prefix_ids: Sequence[int],
    prefix_cache: CacheLike | None = None,
    upstream: Mapping[str, object] | None = None,
    on_token: Callable[[TokenEvent], None] | None = None,
    cancel: CancelCheck | threading.Event | None = None,
    use_chat_template: bool | None = None,
    lock: AbstractContextManager[object] | None = None,
) -> AgentResult:
    """Run ``spec`` on ``model`` after the document prefix ``prefix_ids``; return its result.

    ``prefix_cache`` must hold exactly the prefix positions (PrefixCacheMismatchError otherwise); it is
    copied, never modified. ``None`` re-prefills prefix + suffix from scratch. ``upstream`` maps upstream
    agent names to their outputs (UnknownUpstreamError if the template needs a missing one).
    ``on_token`` is called in this thread for every token; ``cancel`` is polled between tokens
    (GenerationCancelledError). ``lock`` (e.g. the model's `threading.Lock`) is held around every forward
    pass, so other work on the same model (other agents, cache builds) never runs at the same time. Raises ContextOverflowError before any compute when the prompt plus
    max_new_tokens does not fit, and OutputValidationError / TruncatedOutputError for JSON agents whose
    output stays invalid after the repairs.
    """
    clock = _Clock(start=time.perf_counter())
    prefix = list(prefix_ids)
    if not prefix:
        raise ValueError("prefix_ids is empty; build it with DocumentPrompt(...).token_ids(tokenizer)")
    if prefix_cache is not None:
        check_prefix_cache(prefix_cache, len(prefix))
    cancelled = _as_check(cancel)
    eos = eos_token_ids(model, tokenizer)

    # grounding compares against the document as the model saw it: the prefix, decoded, between the markers
    # (`decode` of one id list is one str; transformers types it `str | list[str]` for batches too)
    document = (document_span(cast(str, tokenizer.decode(prefix))) if spec.output.kind == "json" and spec.output.grounded
                else None)
    attempt = _Attempts(model=model, tokenizer=tokenizer, spec=spec, prefix_ids=prefix, prefix_cache=prefix_cache,
                        upstream=upstream, use_chat_template=use_chat_template, eos=eos, on_token=on_token,
                        cancelled=cancelled, clock=clock, lock=lock, document=document)
    with torch.no_grad():
        outcome = _run_agent(attempt)
    return _agent_result(spec, outcome, clock, len(prefix), reprefilled=prefix_cache is None)


@dataclass(frozen=True)
class _Attempts:
    """The decoding attempts of one `generate` call: what every attempt shares; call it to decode one."""

    model: Model | None
    tokenizer: Tokenizer
    spec: AgentSpec
    prefix_ids: list[int]
    prefix_cache: CacheLike | None
    upstream: Mapping[str, object] | None
    use_chat_template: bool | None
    eos: frozenset[int]
    on_token: Callable[[TokenEvent], None] | None
    cancelled: CancelCheck
    clock: _Clock
    lock: AbstractContextManager[object] | None
    document: str | None
    """The document grounded JSON agents are checked against (None for others)."""
    decoder: ReplyDecoder | None = None
    """Where replies are decoded when not on `model` in this process (an engine such as vLLM)."""
    not_applied: set[str] = field(default_factory=set)
    """Settings the decoder could not apply, gathered over the attempts."""
    limit: int | None = None
    """The model's positions, where no `model` says them (a decoder's engine)."""

    def __call__(self, index: int, repairs: Sequence[RepairTurn], turn_spec: AgentSpec | None = None) -> _Generation:
        """Decode attempt ``index`` after the ``repairs`` turns, under ``turn_spec`` (the agent's own by default)."""
        turn_spec = self.spec if turn_spec is None else turn_spec
        own = turn_spec is self.spec
        # a tool round decodes under its own spec (the call grammar) and streams nothing: its reply is a call
        suffix = build_suffix(self.tokenizer, turn_spec, self.upstream, repairs=repairs,
                              use_chat_template=self.use_chat_template)
        if self.decoder is not None:
            return _decode_remote(self, turn_spec, suffix, index, own)
        assert self.model is not None  # an attempt without a decoder decodes on its model
        return _decode_once(self.model, self.tokenizer, turn_spec, self.prefix_ids, self.prefix_cache, suffix,
                            attempt=index, eos=self.eos, on_token=self.on_token if own else None,
                            cancelled=self.cancelled, clock=self.clock, lock=self.lock,
                            document=self.document if own else None)


def _decode_remote(attempts: _Attempts, spec: AgentSpec, suffix: Suffix, index: int, own: bool) -> _Generation:
    """One attempt of `attempts` decoded by its decoder (an engine elsewhere: `agents.remote.generate_with`)."""
    from agents.decoding import DecodeRequest

    decoder = attempts.decoder
    assert decoder is not None
    if attempts.cancelled():
        raise GenerationCancelledError(spec.name, 0)
    document = attempts.document if own else None
    prompt = [*attempts.prefix_ids, *suffix.ids]
    schema = bounded_schema(spec, document)
    # a free-text reply also ends where it starts writing the document markers, as in process
    frame = FRAME_ECHOES if schema is None and spec.output.kind != "json" else ()
    request = DecodeRequest(
        agent=spec.name, prompt_ids=prompt, prefix_tokens=len(attempts.prefix_ids),
        max_new_tokens=reply_budget(attempts.limit, attempts.tokenizer, spec, len(prompt), document),
        settings=spec.generation, schema=schema, stop=(*spec.generation.stop, *frame),
        grounded=spec.output.grounded and document is not None, attempt=index, cancelled=attempts.cancelled)
    emit = _emitter(spec.name, index, attempts.on_token if own else None, attempts.clock)
    started = time.perf_counter()
    try:
        reply = decoder.decode(request, emit)
    finally:
        attempts.clock.generation_s += time.perf_counter() - started
    attempts.not_applied.update(reply.not_applied)
    if attempts.cancelled():
        raise GenerationCancelledError(spec.name, len(reply.token_ids))
    text = reply.text.rstrip(" \t\n#=*-") if frame and reply.stopped_by in frame else reply.text
    return _Generation(text=text, finish_reason=reply.finish_reason, token_ids=list(reply.token_ids),
                       suffix=suffix, constrained=request.schema is not None)


@dataclass(frozen=True)
class _Outcome:
    """The accepted generation of a run and what became known of it, whichever way the agent ran."""

    generation: _Generation
    parsed: object
    attempts: int
    degenerate: Degeneracy | None = None
    grounding: Grounding | None = None
    duplicates_removed: int = 0
    tool_calls: list[ToolCall] = field(default_factory=list)


def _run_agent(attempt: _Attempts) -> _Outcome:
    """Run the agent its way: tool rounds, a JSON reply with its repairs, or one text reply."""
    spec = attempt.spec
    if spec.tools:
        return _run_with_tools(attempt)
    if spec.output.kind == "json":
        structured = run_with_repairs(spec, attempt, document=attempt.document)
        return _Outcome(structured.generation, structured.value, structured.attempts,
                        degenerate=structured.degenerate, grounding=structured.grounding,
                        duplicates_removed=structured.duplicates_removed)
    result = attempt(0, ())
    return _Outcome(result, None, 1, degenerate=check_text(result.text, spec=spec))


def _run_with_tools(attempt: _Attempts) -> _Outcome:
    """Run an agent with tools: its rounds of calls, then its answer, streamed once it is known."""
    spec = attempt.spec
    text = document_span(cast(str, attempt.tokenizer.decode(attempt.prefix_ids)))
    result, calls = _tool_rounds(spec, lambda i, turn_spec, turns: attempt(i, turns, turn_spec), text)
    if attempt.on_token is not None and result.text:  # the answer, once it is known (the rounds are calls)
        attempt.on_token(TokenEvent(agent=spec.name, text=result.text, token_id=-1, index=0, attempt=len(calls)))
    return _Outcome(result, None, len(calls) + 1, degenerate=check_text(result.text, spec=spec), tool_calls=calls)


def _agent_result(spec: AgentSpec, outcome: _Outcome, clock: _Clock, prefix_tokens: int, *,
                  reprefilled: bool, not_applied: set[str] | frozenset[str] = frozenset()) -> AgentResult:
    """The `AgentResult` of a finished run, timed up to now."""
    result = outcome.generation
    assert result.suffix is not None
    return AgentResult(
        agent=spec.name,
        text=result.text,
        parsed=outcome.parsed,
        token_ids=result.token_ids,
        finish_reason=result.finish_reason,
        attempts=outcome.attempts,
        generated_tokens=clock.generated,
        prefix_tokens=prefix_tokens,
        suffix_tokens=len(result.suffix.ids),
        reprefilled=reprefilled,
        timings=clock.timings(),
        constrained=result.constrained,
        degenerate=outcome.degenerate,
        grounding=outcome.grounding,
        duplicates_removed=outcome.duplicates_removed,
        tool_calls=outcome.tool_calls,
        not_applied=sorted(not_applied),
    )


def _tool_rounds(spec: AgentSpec, attempt: Callable[[int, AgentSpec, Sequence[RepairTurn]], _Generation],
                 document: str) -> tuple[_Generation, list[ToolCall]]:
    """Decode rounds under the grammar of a tool call or an answer; run each call; end at the answer.

    Each call and its result become a turn after the agent's own suffix, over the same document prefix; after
    `max_tool_rounds` calls the grammar allows only the answer. A sync tool that overran its timeout runs on
    in its thread (Python cannot stop it), its result discarded: the agent's run ends once that thread has.
    """
    with ToolWorkers() as workers:
        return _rounds(spec, attempt, document, workers)


def _rounds(spec: AgentSpec, attempt: Callable[[int, AgentSpec, Sequence[RepairTurn]], _Generation],
            document: str, workers: ToolWorkers) -> tuple[_Generation, list[ToolCall]]:
    tools = list(spec.tools)
    turns: list[RepairTurn] = []
    calls: list[ToolCall] = []
    for index in range(spec.max_tool_rounds + 1):
        may_call = index < spec.max_tool_rounds
        must_call = index == 0 and spec.tool_choice == "required"
        round_spec = spec.model_copy(update={"tools": (), "output": OutputSpec(
            kind="json", json_schema=round_schema(tools, may_call=may_call, must_call=must_call), max_repairs=0,
            instructions=round_instructions(tools, may_call=may_call))})
        generation = attempt(index, round_spec, turns)
        reply = extract_json_object(generation.text)
        if reply is None and may_call and generation.finish_reason == "length" and '"answer"' not in generation.text:
            # a call cut off at max_new_tokens: the agent is told so and may try again (or answer)
            call = ToolCall("?", {}, f"error: the call was cut off after {spec.generation.max_new_tokens} tokens; "
                            "make it shorter", False, 0.0, index)
        elif reply is None or "tool" not in reply or not may_call:
            return replace(generation, text=answer_text(generation.text)), calls
        else:
            call = run_tool(tools, str(reply.get("tool")), reply.get("arguments"), document=document, round=index,
                            workers=workers)
        calls.append(call)
        turns.append(RepairTurn(previous_output=generation.text.strip(),
                                instruction=f"Result of {call.name}: {call.result}"))
    raise AssertionError("unreachable: the last round allows only the answer")
