"""Prompt layout: a shared, model-independent document prefix, then a per-agent suffix.

The prefix is a fixed preamble, the document between markers, and a final newline. It never depends on
the agent or the model, so its token ids (and so its KV cache) are identical for every agent and every
family member sharing the tokenizer. Everything agent-specific (role, task, upstream outputs, repair
turns) goes in the suffix. When the tokenizer has a chat template it is applied to the suffix only.

Prefix and suffix are tokenized separately and their ids concatenated; the joined string is never
re-tokenized, so the token boundary at the end of the prefix is the same for the cached path and the
re-prefill path.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agents.errors import EmptyDocumentError
from agents.spec import AgentSpec

__all__ = [
    "DEFAULT_PREAMBLE",
    "DOCUMENT_START",
    "DOCUMENT_END",
    "DocumentPrompt",
    "RepairTurn",
    "Suffix",
    "build_suffix",
    "suffix_ids",
    "has_chat_template",
]

DEFAULT_PREAMBLE = (
    "You will be given a document. Read it carefully: instructions about it follow after the end of "
    "the document.\n\n"
)
DOCUMENT_START = "=== DOCUMENT START ===\n"
DOCUMENT_END = "\n=== DOCUMENT END ===\n"


# Fast tokenizers may re-configure themselves while encoding; agents encode from worker threads.
_ENCODE_LOCK = threading.Lock()


def _encode(tokenizer: Any, text: str, *, split_special_tokens: bool = False) -> list[int]:
    """Token ids of ``text`` without any special tokens added."""
    with _ENCODE_LOCK:
        if split_special_tokens:
            try:
                return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
            except TypeError:  # a tokenizer that does not know the option
                pass
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _leading_bos(tokenizer: Any) -> list[int]:
    """[bos_id] if the tokenizer adds a BOS token at the start of a sequence by itself, else []."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return []
    with _ENCODE_LOCK:
        with_special = list(tokenizer("a", add_special_tokens=True)["input_ids"])
        without = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    return [bos] if with_special[:1] == [bos] and without[:1] != [bos] else []


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


@dataclass(frozen=True)
class DocumentPrompt:
    """The shared prefix: fixed preamble + the document between markers, ending at a newline."""

    document: str
    preamble: str = DEFAULT_PREAMBLE

    def __post_init__(self) -> None:
        if not self.document.strip():
            raise EmptyDocumentError("the document is empty; give a document with some text to analyse")

    @property
    def text(self) -> str:
        """The prefix as text (without any BOS token the tokenizer may add)."""
        return f"{self.preamble}{DOCUMENT_START}{self.document.strip()}{DOCUMENT_END}"

    def token_ids(self, tokenizer: Any) -> list[int]:
        """The prefix token ids: [BOS if the tokenizer adds one] + ids of ``text``.

        Special-token strings inside the document are tokenized as plain text, so a document cannot
        inject control tokens (e.g. a chat template's end-of-turn marker).
        """
        return _leading_bos(tokenizer) + _encode(tokenizer, self.text, split_special_tokens=True)


@dataclass(frozen=True)
class RepairTurn:
    """A previous, rejected reply and the instruction that asks the model to fix it."""

    previous_output: str
    instruction: str


@dataclass(frozen=True)
class Suffix:
    """The agent-specific part of the prompt, as text and as token ids."""

    text: str
    ids: tuple[int, ...]
    chat_template: bool


def _user_message(spec: AgentSpec, upstream: Mapping[str, Any] | None) -> str:
    task = spec.render_task(upstream).strip()
    fmt = spec.output.format_instructions()
    return f"{task}\n\n{fmt}" if fmt else task


def _plain_suffix(spec: AgentSpec, user: str, repairs: Sequence[RepairTurn]) -> str:
    text = f"\n### Instructions\n{spec.role.strip()}\n\n### Task\n{user}\n\n### Response\n"
    for turn in repairs:
        text += f"{turn.previous_output}\n\n### Correction\n{turn.instruction}\n\n### Response\n"
    return text


def _chat_suffix(tokenizer: Any, spec: AgentSpec, user: str, repairs: Sequence[RepairTurn]) -> str:
    turns: list[dict[str, str]] = [{"role": "user", "content": user}]
    for turn in repairs:
        turns += [{"role": "assistant", "content": turn.previous_output},
                  {"role": "user", "content": turn.instruction}]
    messages = [{"role": "system", "content": spec.role.strip()}, *turns]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception:  # templates without a system role: put the instructions in the first user turn
        merged = [dict(t) for t in turns]
        merged[0]["content"] = f"{spec.role.strip()}\n\n{merged[0]['content']}"
        text = tokenizer.apply_chat_template(merged, tokenize=False, add_generation_prompt=True)
    bos_text = getattr(tokenizer, "bos_token", None)
    if bos_text and _leading_bos(tokenizer) and text.startswith(bos_text):
        text = text[len(bos_text):]  # the prefix already starts with BOS; never repeat it mid-sequence
    return text


def build_suffix(
    tokenizer: Any,
    spec: AgentSpec,
    upstream: Mapping[str, Any] | None = None,
    *,
    repairs: Sequence[RepairTurn] = (),
    use_chat_template: bool | None = None,
) -> Suffix:
    """The agent's suffix: role, rendered task (+ format instructions) and any repair turns.

    ``use_chat_template``: None applies the tokenizer's chat template when it has one.
    Raises UnknownUpstreamError when the task references an upstream output not in ``upstream``.
    """
    user = _user_message(spec, upstream)
    chat = has_chat_template(tokenizer) if use_chat_template is None else use_chat_template
    text = _chat_suffix(tokenizer, spec, user, repairs) if chat else _plain_suffix(spec, user, repairs)
    return Suffix(text=text, ids=tuple(_encode(tokenizer, text)), chat_template=chat)


def suffix_ids(tokenizer: Any, spec: AgentSpec, upstream: Mapping[str, Any] | None = None) -> list[int]:
    """Token ids of the agent-specific suffix (see build_suffix)."""
    return list(build_suffix(tokenizer, spec, upstream).ids)
