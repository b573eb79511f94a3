"""Grammar-constrained decoding: replies that cannot be malformed JSON.

`JsonConstraint` wraps xgrammar. Why xgrammar: it is the structured-generation engine vLLM and SGLang
use (so replies match what those servers would constrain), it compiles a JSON schema (types, required
keys, enums, minItems/maxItems, string lengths) into a grammar once and then computes each step's
allowed-token bitmask in C++ (milliseconds per step on CPU for a 49k vocabulary), and it works from a
Hugging Face tokenizer without per-model glue. Agents use it for every JSON output (the schema of the
OutputSpec's pydantic model); the server for response_format. At
every step it masks the logits to the tokens that keep the output a prefix of a valid JSON object
(following a JSON schema when one is given) and, once the object is complete, allows only
end-of-sequence. Compiled grammars are cached per tokenizer and schema.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol, TypedDict

if TYPE_CHECKING:
    import torch
    import xgrammar

    from mappings.types import Tokenizer

__all__ = ["TokenConstraint", "JsonConstraint", "GRAMMAR_INSTALL", "require_grammar"]

GRAMMAR_INSTALL = "pip install 'xgrammar>=0.1.20'"


def require_grammar() -> None:
    """Raise `MissingDependencyError` (with the pip command) unless xgrammar can be imported."""
    import importlib.util

    if importlib.util.find_spec("xgrammar") is None:
        from agents.errors import MissingDependencyError

        raise MissingDependencyError(
            f"JSON agents decode under a grammar of their schema and xgrammar is not installed: {GRAMMAR_INSTALL} "
            "(it is a core dependency of orchestra-kv; reinstall the package)", name="xgrammar")


class TokenConstraint(Protocol):
    """What a decoding loop asks of a constraint, once per generated token."""

    def mask(self, logits: torch.Tensor) -> None:
        """Set the logits ([vocab], in place) of every token not allowed next to -inf."""

    def accept(self, token_id: int) -> None:
        """Advance past the sampled token."""

    def finished(self) -> bool:
        """True once the output is complete (only end-of-sequence may follow)."""


_LOCK = threading.Lock()
_COMPILERS: dict[tuple[int, int], xgrammar.GrammarCompiler] = {}
_GRAMMARS: OrderedDict[tuple[int, int, str], xgrammar.CompiledGrammar] = OrderedDict()


class _Layout(TypedDict, total=False):
    """xgrammar's JSON layout options (`GrammarCompiler.compile_json_schema` keywords)."""

    any_whitespace: bool
    indent: int


_MAX_GRAMMARS = 256  # compiled schemas kept; a server taking arbitrary schemas must not grow without bound


class JsonConstraint:
    """Tokens restricted to a JSON object, optionally following `schema`."""

    def __init__(self, compiled: xgrammar.CompiledGrammar, vocab_size: int) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self._matcher = xgr.GrammarMatcher(compiled)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self.vocab_size = vocab_size

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, schema: Mapping[str, object] | None = None, *, vocab_size: int | None = None,
                      fixed_layout: bool = False) -> JsonConstraint:
        """A fresh constraint (one per generation); `vocab_size` is the model's logits width when it pads the vocab.

        ``fixed_layout``: the JSON must be laid out with a 2-space indent and no other whitespace (agents:
        a small model cannot pad the object with newlines until max_new_tokens, and pretty-printed JSON is
        what small instruct models write best; measured on SmolLM2-135M, compact one-line JSON made it
        loop on one word). False keeps JSON's any-whitespace grammar (the server).
        """
        import xgrammar as xgr

        size = int(vocab_size or len(tokenizer))
        key = (id(tokenizer), size)
        text = (json.dumps(schema, sort_keys=True) if schema is not None else "") + ("\x00fixed" if fixed_layout else "")
        grammar_key = (*key, text)
        with _LOCK:
            compiler = _COMPILERS.get(key)
            if compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=size)
                compiler = _COMPILERS[key] = xgr.GrammarCompiler(info)
            compiled = _GRAMMARS.get(grammar_key)
            if compiled is not None:
                _GRAMMARS.move_to_end(grammar_key)
            if compiled is None:
                layout: _Layout = {"any_whitespace": False, "indent": 2} if fixed_layout else {}
                if schema is not None:
                    compiled = compiler.compile_json_schema(json.dumps(schema, sort_keys=True), **layout)
                elif fixed_layout:
                    compiled = compiler.compile_json_schema('{"type": "object"}', **layout)
                else:
                    compiled = compiler.compile_builtin_json_grammar()
                _GRAMMARS[grammar_key] = compiled
                while len(_GRAMMARS) > _MAX_GRAMMARS:
                    _GRAMMARS.popitem(last=False)
        return cls(compiled, size)

    def mask(self, logits: torch.Tensor) -> None:
        self._matcher.fill_next_token_bitmask(self._bitmask)
        view = logits.view(1, -1)[:, : self.vocab_size]
        self._xgr.apply_token_bitmask_inplace(view, self._bitmask.to(view.device))

    def accept(self, token_id: int) -> None:
        if not self._matcher.is_terminated():
            self._matcher.accept_token(int(token_id))

    def finished(self) -> bool:
        return bool(self._matcher.is_terminated())
