"""Agent specifications, prompt layout and running one agent on one model over a shared document cache.

Layout: the document prefix (`DocumentPrompt`) is identical for every agent and family member, so its
KV cache is computed once (`prefill_document`) and shared; each agent adds its own suffix
(`build_suffix`) and decodes over a private copy of that cache (`generate`, or async `run_agent` /
`stream_agent`). Servers continue any cached prefix with their own token ids (`continue_ids`:
chat turns, completions). Only the errors are imported eagerly: torch and transformers load when a name
that needs them is first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from agents.errors import (
    AgentError,
    AgentOutputError,
    CodeNotAllowedError,
    ContextOverflowError,
    EmptyDocumentError,
    GenerationCancelledError,
    InvalidTemplateError,
    OutputValidationError,
    PrefixCacheMismatchError,
    TruncatedOutputError,
    UnknownUpstreamError,
)
from agents.references import UNRESTRICTED, CodePolicy, code_policy, import_reference

__all__ = [
    # errors
    "AgentError",
    "AgentOutputError",
    "ContextOverflowError",
    "EmptyDocumentError",
    "GenerationCancelledError",
    "InvalidTemplateError",
    "OutputValidationError",
    "PrefixCacheMismatchError",
    "TruncatedOutputError",
    "UnknownUpstreamError",
    "CodeNotAllowedError",
    # Python named by 'module:function', imported under a code policy
    "CodePolicy",
    "UNRESTRICTED",
    "code_policy",
    "import_reference",
    # specs
    "AgentSpec",
    "GenerationSettings",
    "OutputSpec",
    "escape_template",
    "upstream_text",
    # prompt layout
    "DEFAULT_PREAMBLE",
    "DocumentPrompt",
    "RepairTurn",
    "Suffix",
    "build_suffix",
    "suffix_ids",
    # caches and prefill
    "Prefill",
    "prefill_document",
    "copy_cache",
    "cache_length",
    "check_context",
    "max_positions",
    "forward_cache_kwarg",
    "forward_tokens",
    # running agents
    "TokenEvent",
    "AgentTimings",
    "AgentResult",
    "generate",
    "eos_token_ids",
    "AgentStream",
    "stream_agent",
    "run_agent",
    # continuing a cached prefix (servers)
    "Continuation",
    "continue_ids",
    # structured output
    "extract_json_object",
    "parse_output",
    "run_with_repairs",
    # built-in agents
    "KeyFacts",
    "summarizer",
    "key_facts",
    "question_answerer",
    "critic",
    "report_writer",
    "BUILTINS",
]

_LAZY = {
    "AgentSpec": "agents.spec",
    "GenerationSettings": "agents.spec",
    "OutputSpec": "agents.spec",
    "escape_template": "agents.spec",
    "upstream_text": "agents.spec",
    "DEFAULT_PREAMBLE": "agents.prompt",
    "DocumentPrompt": "agents.prompt",
    "RepairTurn": "agents.prompt",
    "Suffix": "agents.prompt",
    "build_suffix": "agents.prompt",
    "suffix_ids": "agents.prompt",
    "Prefill": "agents.kv",
    "prefill_document": "agents.kv",
    "copy_cache": "agents.kv",
    "cache_length": "agents.kv",
    "check_context": "agents.kv",
    "max_positions": "agents.kv",
    "forward_cache_kwarg": "agents.kv",
    "forward_tokens": "agents.kv",
    "TokenEvent": "agents.runner",
    "AgentTimings": "agents.runner",
    "AgentResult": "agents.runner",
    "generate": "agents.runner",
    "eos_token_ids": "agents.runner",
    "AgentStream": "agents.streaming",
    "stream_agent": "agents.streaming",
    "run_agent": "agents.streaming",
    "Continuation": "agents.continuation",
    "continue_ids": "agents.continuation",
    "extract_json_object": "agents.structured",
    "parse_output": "agents.structured",
    "run_with_repairs": "agents.structured",
    "KeyFacts": "agents.builtin",
    "summarizer": "agents.builtin",
    "key_facts": "agents.builtin",
    "question_answerer": "agents.builtin",
    "critic": "agents.builtin",
    "report_writer": "agents.builtin",
    "BUILTINS": "agents.builtin",
}

if TYPE_CHECKING:
    from agents.builtin import (
        BUILTINS,
        KeyFacts,
        critic,
        key_facts,
        question_answerer,
        report_writer,
        summarizer,
    )
    from agents.continuation import Continuation, continue_ids
    from agents.kv import (
        Prefill,
        cache_length,
        check_context,
        copy_cache,
        forward_cache_kwarg,
        forward_tokens,
        max_positions,
        prefill_document,
    )
    from agents.prompt import DEFAULT_PREAMBLE, DocumentPrompt, RepairTurn, Suffix, build_suffix, suffix_ids
    from agents.runner import AgentResult, AgentTimings, TokenEvent, eos_token_ids, generate
    from agents.spec import AgentSpec, GenerationSettings, OutputSpec, escape_template, upstream_text
    from agents.streaming import AgentStream, run_agent, stream_agent
    from agents.structured import extract_json_object, parse_output, run_with_repairs


def __getattr__(name: str) -> object:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'agents' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
