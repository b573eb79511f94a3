"""Prompt layout: a shared document prefix, identical for every agent and family member, then a per-agent suffix.

Two layouts, chosen by a deterministic function of the tokenizer (`chat_native`), so that the prefix
(`DocumentPrompt.token_ids`) and every suffix (`build_suffix`) always agree:

* **chat-native** (the tokenizer has a chat template that renders a content-independent head): the
  prefix is the template's head (a generic system message and an opened first user turn) followed by
  the document between markers; the suffix continues that user turn with the agent's role and task,
  closes it with the template's own end-of-turn, and opens the assistant turn. JSON repair turns
  follow as further assistant / user turns. Instruct models are trained on exactly this shape; a
  document outside any chat turn (the old layout) made small models ignore it.
* **raw** (base models without a template, or a template whose head depends on the content): a
  plain-text preamble, the document between markers, and ``### Instructions`` / ``### Response``
  sections in the suffix.

The chat-native split is found by rendering the template with a placeholder where the document goes
and cutting at the placeholder; the head must come out identical for different agent texts and with
repair turns, otherwise the raw layout is used. Nothing agent- or member-specific is in the prefix,
so its token ids (and so its KV cache) are shared by every agent and every member with this tokenizer.

Prefix and suffix are tokenized separately and their ids concatenated; the joined string is never
re-tokenized, so the token boundary at the end of the prefix is the same for the cached path and the
re-prefill path. The document is tokenized with ``split_special_tokens=True``: a document containing
``<|im_end|>`` cannot close the turn or inject any control token.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agents.errors import EmptyDocumentError
from agents.spec import AgentSpec

if TYPE_CHECKING:
    from mappings.types import Tokenizer

__all__ = [
    "DEFAULT_PREAMBLE",
    "DOCUMENT_START",
    "DOCUMENT_END",
    "FRAME_ECHOES",
    "SYSTEM_MESSAGE",
    "CHAT_DOCUMENT_INTRO",
    "DocumentPrompt",
    "RepairTurn",
    "Suffix",
    "build_suffix",
    "suffix_ids",
    "has_chat_template",
    "chat_native",
    "document_span",
    "encode_document_text",
]

DEFAULT_PREAMBLE = (
    "You will be given a document. Read it carefully: instructions about it follow after the end of "
    "the document.\n\n"
)
DOCUMENT_START = "=== DOCUMENT START ===\n"
DOCUMENT_END = "\n=== DOCUMENT END ===\n"
FRAME_ECHOES = (DOCUMENT_START.strip("= \n"), DOCUMENT_END.strip("= \n"))
"""The document markers' words: a text reply that writes them has left its answer to copy its own prompt
(a 135M reduce agent wrote "### DOCUMENT START ===" and its role text after a good summary), so they end it."""

SYSTEM_MESSAGE = (
    "You are a careful assistant. You read the document the user gives you and follow the user's "
    "instructions about it, using only what the document says."
)
"""The chat-native system message: generic, because it precedes the document and is shared by every agent."""
CHAT_DOCUMENT_INTRO = "Here is a document. My instructions follow after it.\n\n"
"""Opens the first user turn, before the document markers (chat-native layout)."""

_PLACEHOLDER = "\u0000ORCHESTRA-DOCUMENT\u0000"  # where the document goes when the template is rendered
_PROBES = ("Write one word.", "Answer the question in two sentences, please.")  # two different agent texts


# Fast tokenizers may re-configure themselves while encoding; agents encode from worker threads.
_ENCODE_LOCK = threading.Lock()


def _encode(tokenizer: Tokenizer, text: str, *, split_special_tokens: bool = False) -> list[int]:
    """Token ids of ``text`` without any special tokens added."""
    with _ENCODE_LOCK:
        if split_special_tokens:
            try:
                return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
            except TypeError:  # a tokenizer that does not know the option
                pass
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def encode_document_text(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of `text` as document text is tokenized in a prefix (special-token strings as plain text)."""
    return _encode(tokenizer, text, split_special_tokens=True)


def _leading_bos(tokenizer: Tokenizer) -> list[int]:
    """[bos_id] if the tokenizer adds a BOS token at the start of a sequence by itself, else []."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return []
    with _ENCODE_LOCK:
        with_special = list(tokenizer("a", add_special_tokens=True)["input_ids"])
        without = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    return [bos] if with_special[:1] == [bos] and without[:1] != [bos] else []


def has_chat_template(tokenizer: Tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


@dataclass(frozen=True)
class _ChatLayout:
    """How a tokenizer's chat template is split around the document."""

    head: str
    """Rendered template text before the document (system message, opened user turn)."""
    system_role: bool
    """False when the template refuses a system message: the system text then leads the user turn."""


_LAYOUTS: dict[tuple[int, str], _ChatLayout | None] = {}
_LAYOUT_LOCK = threading.Lock()


def _messages(system_role: bool, agent_text: str, repairs: Sequence[RepairTurn]) -> list[dict[str, str]]:
    user = f"{_PLACEHOLDER}{agent_text}"
    first = [{"role": "system", "content": SYSTEM_MESSAGE}, {"role": "user", "content": user}] if system_role else [
        {"role": "user", "content": f"{SYSTEM_MESSAGE}\n\n{user}"}]
    for turn in repairs:
        first += [{"role": "assistant", "content": turn.previous_output}, {"role": "user", "content": turn.instruction}]
    return first


def _render(tokenizer: Tokenizer, system_role: bool, agent_text: str, repairs: Sequence[RepairTurn]) -> str:
    with _ENCODE_LOCK:
        return str(tokenizer.apply_chat_template(_messages(system_role, agent_text, repairs), tokenize=False,
                                                 add_generation_prompt=True))


def _find_layout(tokenizer: Tokenizer) -> _ChatLayout | None:
    probe_repair = (RepairTurn(previous_output="{}", instruction="Try again."),)
    for system_role in (True, False):
        try:
            renders = [_render(tokenizer, system_role, f"\n{probe}", ()) for probe in _PROBES]
            renders.append(_render(tokenizer, system_role, f"\n{_PROBES[0]}", probe_repair))
        except Exception:  # e.g. raise_exception('system role not supported'): try the next shape
            continue
        parts = [text.split(_PLACEHOLDER) for text in renders]
        if any(len(p) != 2 for p in parts):
            return None  # the template drops, repeats or escapes the content: no clean split
        heads = {p[0] for p in parts}
        if len(heads) != 1 or not all(probe in p[1] for probe, p in zip(_PROBES, parts, strict=False)):
            return None  # the head depends on the content: it could not be shared
        return _ChatLayout(head=parts[0][0], system_role=system_role)
    return None


def _chat_layout(tokenizer: Tokenizer) -> _ChatLayout | None:
    """The tokenizer's chat-native layout, or None for the raw layout (cached per tokenizer and template)."""
    template = getattr(tokenizer, "chat_template", None)
    if not template or not isinstance(template, str):
        return None  # no template (or several named ones): raw layout
    key = (id(tokenizer), template)
    with _LAYOUT_LOCK:
        if key in _LAYOUTS:
            return _LAYOUTS[key]
    layout = _find_layout(tokenizer)
    with _LAYOUT_LOCK:
        _LAYOUTS[key] = layout
    return layout


def chat_native(tokenizer: Tokenizer) -> bool:
    """Whether prompts for this tokenizer use the chat-native layout (the same answer for prefix and suffix)."""
    return _chat_layout(tokenizer) is not None


def _resolve(tokenizer: Tokenizer, use_chat_template: bool | None) -> _ChatLayout | None:
    if use_chat_template is False:
        return None
    layout = _chat_layout(tokenizer)
    if use_chat_template and layout is None:
        raise ValueError("use_chat_template=True but the tokenizer has no chat template that can hold a shared "
                         "document prefix (none, or its head depends on the content)")
    return layout


def _document_block(document: str) -> str:
    return f"{DOCUMENT_START}{document.strip()}{DOCUMENT_END}"


def document_span(prompt_text: str) -> str:
    """The document inside a decoded prefix (between the markers), or the whole text if the markers are absent."""
    start = prompt_text.find(DOCUMENT_START)
    end = prompt_text.rfind(DOCUMENT_END)
    if start < 0 or end < start:
        return prompt_text
    return prompt_text[start + len(DOCUMENT_START): end]


@dataclass(frozen=True)
class DocumentPrompt:
    """The shared prefix: the document between markers, after a chat template's head or a plain preamble."""

    document: str
    preamble: str = DEFAULT_PREAMBLE
    """Raw layout only: the text before the document."""
    use_chat_template: bool | None = None
    """None: chat-native when the tokenizer allows it (`chat_native`); False: always the raw layout."""

    def __post_init__(self) -> None:
        if not self.document.strip():
            raise EmptyDocumentError("the document is empty; give a document with some text to analyse")

    @property
    def text(self) -> str:
        """The raw-layout prefix as text (without any BOS token the tokenizer may add)."""
        return f"{self.preamble}{_document_block(self.document)}"

    def text_for(self, tokenizer: Tokenizer) -> str:
        """The prefix as text in the layout this tokenizer gets (without a BOS the tokenizer adds by itself)."""
        layout = _resolve(tokenizer, self.use_chat_template)
        if layout is None:
            return self.text
        return f"{layout.head}{CHAT_DOCUMENT_INTRO}{_document_block(self.document)}"

    def token_ids(self, tokenizer: Tokenizer) -> list[int]:
        """The prefix token ids (identical for every agent; for every member sharing the tokenizer).

        Special-token strings inside the document are tokenized as plain text, so a document cannot
        inject control tokens (e.g. a chat template's end-of-turn marker).
        """
        layout = _resolve(tokenizer, self.use_chat_template)
        if layout is None:
            return _leading_bos(tokenizer) + _encode(tokenizer, self.text, split_special_tokens=True)
        head = _encode(tokenizer, layout.head + CHAT_DOCUMENT_INTRO)  # the template's control tokens are real
        bos = getattr(tokenizer, "bos_token_id", None)
        lead = _leading_bos(tokenizer) if head[:1] != [bos] else []  # the model expects BOS; never twice
        return lead + head + _encode(tokenizer, _document_block(self.document), split_special_tokens=True)


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
    """True for the chat-native layout (the suffix closes the document's user turn)."""


def _user_message(spec: AgentSpec, upstream: Mapping[str, object] | None) -> str:
    task = spec.render_task(upstream).strip()
    fmt = spec.output.format_instructions()
    return f"{task}\n\n{fmt}" if fmt else task


def _plain_suffix(spec: AgentSpec, user: str, repairs: Sequence[RepairTurn]) -> str:
    role = spec.role.strip()
    text = (f"\n### Instructions\n{role}\n" if role else "") + f"\n### Task\n{user}\n\n### Response\n"
    for turn in repairs:
        text += f"{turn.previous_output}\n\n### Correction\n{turn.instruction}\n\n### Response\n"
    return text


def _chat_suffix(tokenizer: Tokenizer, layout: _ChatLayout, spec: AgentSpec, user: str,
                 repairs: Sequence[RepairTurn]) -> str:
    role = spec.role.strip()
    agent_text = f"\n{role}\n\n{user}" if role else f"\n{user}"
    rendered = _render(tokenizer, layout.system_role, agent_text, repairs)
    head, sep, tail = rendered.partition(_PLACEHOLDER)
    if not sep or head != layout.head:  # checked when the layout was found; a template with state could still differ
        raise ValueError("the chat template rendered a different head for this agent; the document prefix cannot be "
                         "shared (pass use_chat_template=False to use the raw layout)")
    return tail


def build_suffix(
    tokenizer: Tokenizer,
    spec: AgentSpec,
    upstream: Mapping[str, object] | None = None,
    *,
    repairs: Sequence[RepairTurn] = (),
    use_chat_template: bool | None = None,
) -> Suffix:
    """The agent's suffix: role, rendered task (+ format instructions), the turn close and any repair turns.

    ``use_chat_template``: None follows `chat_native(tokenizer)` (as `DocumentPrompt` does); it must
    match what the prefix was built with. Raises UnknownUpstreamError when the task references an
    upstream output not in ``upstream``.
    """
    user = _user_message(spec, upstream)
    layout = _resolve(tokenizer, use_chat_template)
    if layout is None:
        text = _plain_suffix(spec, user, repairs)
    else:
        text = _chat_suffix(tokenizer, layout, spec, user, repairs)
    return Suffix(text=text, ids=tuple(_encode(tokenizer, text)), chat_template=layout is not None)


def suffix_ids(tokenizer: Tokenizer, spec: AgentSpec, upstream: Mapping[str, object] | None = None) -> list[int]:
    """Token ids of the agent-specific suffix (see build_suffix)."""
    return list(build_suffix(tokenizer, spec, upstream).ids)
