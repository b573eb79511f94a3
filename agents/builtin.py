"""Built-in agents for long documents, with prompts short and explicit enough for small instruct models.

Each built-in is a factory that returns an `AgentSpec`. Pipelines (YAML ``builtin: key_facts`` or
``Pipeline.agent("key_facts")``) find them only through the explicit `BUILTINS` registry, never by
attribute lookup on this module, so helpers that live here (`KeyFacts`, pydantic's `Field`, private
functions) can never be mistaken for an agent. The factories validate their arguments
(`pydantic.validate_call`): an unknown keyword, a missing argument or a wrong type is a
`pydantic.ValidationError` naming the argument, which the pipeline layer turns into a message naming
the agent and the field.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Annotated, Literal

from pydantic import BaseModel, Field, StringConstraints, validate_call

from agents.spec import (
    AGENT_NAME_PATTERN,
    AgentSpec,
    GenerationSettings,
    MaxNewTokens,
    OutputSpec,
    escape_template,
)
from mappings.repair import RepairPolicy

__all__ = ["KeyFacts", "summarizer", "key_facts", "question_answerer", "QA_REPAIR", "critic", "report_writer", "BUILTINS"]

AgentName = Annotated[str, Field(pattern=AGENT_NAME_PATTERN)]
"""An agent name as a template can reference it (letters, digits, _ or -; not starting with a digit)."""

_ONLY_DOCUMENT = "Use only what the document says."

# Repetition control for free-text built-ins: a 135M model left alone loops on a phrase or pads with blank
# lines. The penalty only sees the reply, so quoting the document stays free; 6 tokens still allow short
# recurring phrases ("the Program", "you must") while a copied sentence cannot come back.
_TEXT = {"repetition_penalty": 1.15, "no_repeat_ngram_size": 6}


class KeyFacts(BaseModel):
    """The key-facts extractor's structured output."""

    facts: list[Annotated[str, StringConstraints(min_length=1, max_length=300)]] = Field(min_length=1, max_length=32)
    """Short, self-contained factual statements taken from the document (a grammar bounds the list)."""


@validate_call
def summarizer(name: AgentName = "summarizer", *, max_words: Annotated[int, Field(ge=1)] = 150,
               max_new_tokens: MaxNewTokens = 256) -> AgentSpec:
    """Summarizes the whole document in at most ``max_words`` words."""
    return AgentSpec(
        name=name,
        role=f"You write short, accurate summaries. {_ONLY_DOCUMENT}",
        task=(
            f"Summarize the document above in {max_words} words or fewer. Say what kind of document it is, "
            f"then its main points, in plain sentences."
        ),
        generation=GenerationSettings(max_new_tokens=max_new_tokens, **_TEXT),
    )


@validate_call
def key_facts(name: AgentName = "key_facts", *, max_facts: Annotated[int, Field(ge=1, le=32)] = 8,
              max_new_tokens: MaxNewTokens = 320, max_repairs: Annotated[int, Field(ge=0, le=5)] = 2,
              grounded: bool = True) -> AgentSpec:
    """Extracts the document's key facts as a validated JSON object ``{"facts": [...]}`` (`KeyFacts`).

    The reply is decoded under a grammar of `KeyFacts`' schema, so it is always well-formed; no literal
    example is shown (small models copy it). ``grounded`` (default): each fact must be a sentence copied
    from the document; facts that are not verbatim spans are dropped and reported (`agents.grounding`).
    """
    how = "Copy each fact word for word from the document." if grounded else "Write each fact as one short sentence."
    return AgentSpec(
        name=name,
        role=f"You pick out the key facts of documents. {_ONLY_DOCUMENT}",
        task=f"List the {max_facts} most important facts in the document above. {how}",
        # a 4-token n-gram ban: without it SmolLM2-135M under the grammar repeats one word as every item
        # ("facts", "facts", ...); no penalty, since JSON structure tokens repeat by design
        generation=GenerationSettings(max_new_tokens=max_new_tokens, no_repeat_ngram_size=4),
        output=OutputSpec(
            kind="json",
            model=KeyFacts,
            max_repairs=max_repairs,
            grounded=grounded,
            max_items=max_facts,
            instructions='Reply in JSON: an object with one key, "facts", whose value is a list of strings.',
        ),
    )


QA_REPAIR = RepairPolicy(budget=0.25, scattered_share=0.5)
"""The repair `question_answerer` asks of a mapped cache (chosen by `benchmarks/qa_repair_curve.py`)."""


@validate_call
def question_answerer(question: Annotated[str, StringConstraints(strip_whitespace=True, min_length=1)],
                      name: AgentName = "answer", *, max_new_tokens: MaxNewTokens = 160,
                      search: bool = False, max_tool_rounds: Annotated[int, Field(ge=1, le=10)] = 2,
                      tool_choice: Literal["auto", "required"] = "auto") -> AgentSpec:
    """Answers ``question`` briefly from the document.

    The wording is the one `benchmarks/qa_prompt_variants.py` measured best against a plain prompt (the document
    then the question in one user turn): no role text (a 135M model repeats a role as its answer), no mention
    of "the document" (it invites answers *about* the document: "The document above contains ...") and no
    repetition penalty, which pushes short extractive answers off the document's words; the 6-token n-gram ban
    that stops verbatim loops costs nothing there. A brief answer is one paragraph, so a blank line or the
    start of a next question ends it (`max_new_tokens` bounds the rest).
    ``search=True`` gives it the `agents.tools.find` tool: it may look up the passages that contain some words
    (up to ``max_tool_rounds`` times) before it answers; each lookup is a turn over the same cached document.
    ``tool_choice="required"`` makes its first reply a lookup.

    On a mapped cache it asks for `QA_REPAIR` (a quarter of a prefill, half of it on the interior tokens the
    source reads most): an extractive answer quotes one detail, and the pure map gets details wrong ("1.0" for
    "2.0"). `benchmarks/qa_repair_curve.py` measured the fine-tuned member answering 13 of 60 on the pure map,
    13 up to a 15% budget, 15 at 20%, 18 at this one, against 17 on its own prefill and 15 with a plain prompt.
    """
    from agents.tools import find

    return AgentSpec(
        name=name,
        role="",
        task=f"Question: {escape_template(question.strip())}\nAnswer briefly.",
        # a tool call's JSON may hold blank lines, so a searching agent stops only at a next question
        generation=GenerationSettings(max_new_tokens=max_new_tokens, no_repeat_ngram_size=_TEXT["no_repeat_ngram_size"],
                                      stop=("\nQuestion:",) if search else ("\n\n", "\nQuestion:")),
        tools=(find,) if search else (),
        max_tool_rounds=max_tool_rounds,
        tool_choice=tool_choice,
        mapped_repair=QA_REPAIR,
    )


@validate_call
def critic(target_agent: AgentName, name: AgentName | None = None, *, max_new_tokens: MaxNewTokens = 256) -> AgentSpec:
    """Checks ``target_agent``'s output against the document and lists unsupported or wrong statements."""
    return AgentSpec(
        name=name or f"{target_agent}_critic",
        role=f"You check texts against documents. {_ONLY_DOCUMENT}",
        task=(
            "Here is a text written about the document above:\n\n"
            f"{{{target_agent}}}\n\n"
            "Check this text against the document. Name each statement in it that is wrong or not in the "
            "document, and say what the document says instead. If every statement is correct, say so."
        ),
        generation=GenerationSettings(max_new_tokens=max_new_tokens, **_TEXT),
    )


@validate_call
def report_writer(upstream: Annotated[Sequence[AgentName], Field(min_length=1)], name: AgentName = "report", *,
                  max_new_tokens: MaxNewTokens = 400) -> AgentSpec:
    """Merges the outputs of the ``upstream`` agents into one final report about the document."""
    names = list(dict.fromkeys(upstream))
    notes = "\n\n".join(f"Notes from {escape_template(n)}:\n{{{n}}}" for n in names)
    return AgentSpec(
        name=name,
        role=f"You write clear reports about documents. {_ONLY_DOCUMENT}",
        task=(
            "Here are notes about the document above:\n\n"
            f"{notes}\n\n"
            "Write a short report about the document that combines these notes. Put the most important points "
            "first and do not repeat yourself."
        ),
        generation=GenerationSettings(max_new_tokens=max_new_tokens, **_TEXT),
    )


BUILTINS: Mapping[str, Callable[..., AgentSpec]] = MappingProxyType({
    "summarizer": summarizer,
    "key_facts": key_facts,
    "question_answerer": question_answerer,
    "critic": critic,
    "report_writer": report_writer,
})
"""The built-in agents by name: the only place a pipeline's ``builtin:`` is looked up (read-only, so
importing a module cannot add to it behind the pipeline's back)."""
