"""Grammar-constrained decoding: replies that cannot be malformed JSON.

`JsonConstraint` wraps xgrammar (the structured-generation engine vLLM and SGLang use: a compiled
grammar, a per-step token bitmask in C++, milliseconds per step on CPU for a 49k vocabulary). At
every step it masks the logits to the tokens that keep the output a prefix of a valid JSON object
(following a JSON schema when one is given) and, once the object is complete, allows only
end-of-sequence. Compiled grammars are cached per tokenizer and schema.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any, Protocol

__all__ = ["TokenConstraint", "JsonConstraint"]


class TokenConstraint(Protocol):
    """What a decoding loop asks of a constraint, once per generated token."""

    def mask(self, logits: Any) -> None:
        """Set the logits ([vocab], in place) of every token not allowed next to -inf."""

    def accept(self, token_id: int) -> None:
        """Advance past the sampled token."""

    def finished(self) -> bool:
        """True once the output is complete (only end-of-sequence may follow)."""


_LOCK = threading.Lock()
_COMPILERS: dict[tuple[int, int], Any] = {}
_GRAMMARS: OrderedDict[tuple[int, int, str], Any] = OrderedDict()
_MAX_GRAMMARS = 256  # compiled schemas kept; a server taking arbitrary schemas must not grow without bound


class JsonConstraint:
    """Tokens restricted to a JSON object, optionally following `schema`."""

    def __init__(self, compiled: Any, vocab_size: int) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self._matcher = xgr.GrammarMatcher(compiled)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self.vocab_size = vocab_size

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, schema: dict[str, Any] | None = None, *, vocab_size: int | None = None
                      ) -> JsonConstraint:
        """A fresh constraint (one per generation); `vocab_size` is the model's logits width when it pads the vocab."""
        import xgrammar as xgr

        size = int(vocab_size or len(tokenizer))
        key = (id(tokenizer), size)
        text = json.dumps(schema, sort_keys=True) if schema is not None else ""
        with _LOCK:
            compiler = _COMPILERS.get(key)
            if compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=size)
                compiler = _COMPILERS[key] = xgr.GrammarCompiler(info)
            compiled = _GRAMMARS.get((*key, text))
            if compiled is not None:
                _GRAMMARS.move_to_end((*key, text))
            if compiled is None:
                compiled = (compiler.compile_json_schema(text) if schema is not None
                            else compiler.compile_builtin_json_grammar())
                _GRAMMARS[(*key, text)] = compiled
                while len(_GRAMMARS) > _MAX_GRAMMARS:
                    _GRAMMARS.popitem(last=False)
        return cls(compiled, size)

    def mask(self, logits: Any) -> None:
        self._matcher.fill_next_token_bitmask(self._bitmask)
        view = logits.view(1, -1)[:, : self.vocab_size]
        self._xgr.apply_token_bitmask_inplace(view, self._bitmask.to(view.device))

    def accept(self, token_id: int) -> None:
        if not self._matcher.is_terminated():
            self._matcher.accept_token(int(token_id))

    def finished(self) -> bool:
        return bool(self._matcher.is_terminated())
