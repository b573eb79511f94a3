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
from typing import Annotated

from pydantic import BaseModel, Field, StringConstraints, validate_call

from agents.spec import (
    AGENT_NAME_PATTERN,
    AgentSpec,
    GenerationSettings,
    MaxNewTokens,
    OutputSpec,
    escape_template,
)

__all__ = ["KeyFacts", "summarizer", "key_facts", "question_answerer", "critic", "report_writer", "BUILTINS"]

AgentName = Annotated[str, Field(pattern=AGENT_NAME_PATTERN)]
"""An agent name as a template can reference it (letters, digits, _ or -; not starting with a digit)."""

_GROUNDED = "Use only information from the document. Do not invent facts."


class KeyFacts(BaseModel):
    """The key-facts extractor's structured output."""

    facts: list[str] = Field(min_length=1)
    """Short, self-contained factual statements taken from the document."""


@validate_call
def summarizer(name: AgentName = "summarizer", *, max_words: Annotated[int, Field(ge=1)] = 150,
               max_new_tokens: MaxNewTokens = 256) -> AgentSpec:
    """Summarizes the whole document in at most ``max_words`` words."""
    return AgentSpec(
        name=name,
        role=f"You are a precise summarizer. {_GROUNDED}",
        task=(
            f"Summarize the document above in at most {max_words} words. Cover its main points in the "
            f"order they appear. Write plain prose."
        ),
        generation=GenerationSettings(max_new_tokens=max_new_tokens),
    )


@validate_call
def key_facts(name: AgentName = "key_facts", *, max_facts: Annotated[int, Field(ge=1)] = 8,
              max_new_tokens: MaxNewTokens = 320, max_repairs: Annotated[int, Field(ge=0, le=5)] = 2) -> AgentSpec:
    """Extracts the document's key facts as a validated JSON object ``{"facts": [...]}`` (`KeyFacts`)."""
    return AgentSpec(
        name=name,
        role=f"You extract key facts from documents and reply in JSON. {_GROUNDED}",
        task=f"List the {max_facts} most important facts stated in the document above, one short sentence each.",
        generation=GenerationSettings(max_new_tokens=max_new_tokens),
        output=OutputSpec(
            kind="json",
            model=KeyFacts,
            max_repairs=max_repairs,
            instructions=(
                'Reply with only a JSON object of this form and nothing else: '
                '{"facts": ["first fact", "second fact"]}'
            ),
        ),
    )


@validate_call
def question_answerer(question: Annotated[str, StringConstraints(strip_whitespace=True, min_length=1)],
                      name: AgentName = "answer", *, max_new_tokens: MaxNewTokens = 160) -> AgentSpec:
    """Answers ``question`` from the document, or says that the document does not answer it."""
    return AgentSpec(
        name=name,
        role=f"You answer questions about documents accurately and briefly. {_GROUNDED}",
        task=(
            "Answer the question below using only the document above. If the document does not contain "
            "the answer, reply exactly: The document does not say.\n\n"
            f"Question: {escape_template(question.strip())}"
        ),
        generation=GenerationSettings(max_new_tokens=max_new_tokens),
    )


@validate_call
def critic(target_agent: AgentName, name: AgentName | None = None, *, max_new_tokens: MaxNewTokens = 256) -> AgentSpec:
    """Checks ``target_agent``'s output against the document and lists unsupported or wrong statements."""
    return AgentSpec(
        name=name or f"{target_agent}_critic",
        role=f"You are a careful fact-checker. {_GROUNDED}",
        task=(
            "Another assistant wrote the following text about the document above:\n\n"
            f"{{{target_agent}}}\n\n"
            "Check that text against the document. List every statement that is wrong or not supported by "
            "the document, and say what the document actually says. If every statement is supported, "
            "reply exactly: No problems found."
        ),
        generation=GenerationSettings(max_new_tokens=max_new_tokens),
    )


@validate_call
def report_writer(upstream: Annotated[Sequence[AgentName], Field(min_length=1)], name: AgentName = "report", *,
                  max_new_tokens: MaxNewTokens = 400) -> AgentSpec:
    """Merges the outputs of the ``upstream`` agents into one final report about the document."""
    names = list(dict.fromkeys(upstream))
    notes = "\n\n".join(f"### Notes from {escape_template(n)}\n{{{n}}}" for n in names)
    return AgentSpec(
        name=name,
        role=f"You write clear, well-organised reports. {_GROUNDED}",
        task=(
            "Other assistants analysed the document above and wrote these notes:\n\n"
            f"{notes}\n\n"
            "Write one final report about the document that merges these notes. Keep what the document "
            "supports, remove repetition, and put the most important points first."
        ),
        generation=GenerationSettings(max_new_tokens=max_new_tokens),
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
