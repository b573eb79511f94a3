"""Built-in agents for long documents, with prompts short and explicit enough for small instruct models."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, Field

from agents.spec import AgentSpec, GenerationSettings, OutputSpec, escape_template

__all__ = ["KeyFacts", "summarizer", "key_facts", "question_answerer", "critic", "report_writer", "BUILTINS"]

_GROUNDED = "Use only information from the document. Do not invent facts."


class KeyFacts(BaseModel):
    """The key-facts extractor's structured output."""

    facts: list[str] = Field(min_length=1)
    """Short, self-contained factual statements taken from the document."""


def summarizer(name: str = "summarizer", *, max_words: int = 150, max_new_tokens: int = 256) -> AgentSpec:
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


def key_facts(name: str = "key_facts", *, max_facts: int = 8, max_new_tokens: int = 320,
              max_repairs: int = 2) -> AgentSpec:
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


def question_answerer(question: str, name: str = "answer", *, max_new_tokens: int = 160) -> AgentSpec:
    """Answers ``question`` from the document, or says that the document does not answer it."""
    if not question.strip():
        raise ValueError("question_answerer needs a non-empty question")
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


def critic(target_agent: str, name: str | None = None, *, max_new_tokens: int = 256) -> AgentSpec:
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


def report_writer(upstream: Sequence[str], name: str = "report", *, max_new_tokens: int = 400) -> AgentSpec:
    """Merges the outputs of the ``upstream`` agents into one final report about the document."""
    names = list(dict.fromkeys(upstream))
    if not names:
        raise ValueError("report_writer needs at least one upstream agent name")
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


BUILTINS = {
    "summarizer": summarizer,
    "key_facts": key_facts,
    "question_answerer": question_answerer,
    "critic": critic,
    "report_writer": report_writer,
}
"""Built-in spec factories by name (for pipeline files that ask for a built-in agent)."""
