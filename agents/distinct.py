"""Distinct list items under a grounded grammar: a choice already made is not offered again.

A grounded JSON agent's grammar lets each list item be any of the document's sentences
(`agents.grounding.grounded_schema`), the same one as often as the model likes. A small model under
that grammar often writes its first sentence again as the second and third item; the repeats are
dropped after decoding (`agents.structured.drop_repeated_items`), but they have spent the reply's
tokens, and a per-chunk reply that began with a repeat was cut off before it named anything new.
`DistinctItems` wraps the grammar: while an item is being written, a token that leads only to
sentences the list already holds is masked, so the model's next-best distinct sentence is taken
instead. Where no allowed token leads anywhere new (every sentence used), the grammar alone decides.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from agents.constrained import TokenConstraint
    from agents.prompt import Tokenizer

__all__ = ["DistinctItems"]

# where the reply is inside a list's string item: the text after the list's opening or a comma and an opening quote
_OPEN_ITEM = re.compile(r'[\[,]\s*"((?:[^"\\]|\\.)*)\Z', re.DOTALL)
_ITEM = re.compile(r'"((?:[^"\\]|\\.)*)"')


class DistinctItems:
    """A `TokenConstraint` around ``inner`` that keeps a list's string items distinct among ``choices``.

    ``choices`` are the strings an item may be (the grounded sentences); they are compared in their JSON
    string form, as the reply spells them.
    """

    def __init__(self, inner: TokenConstraint, tokenizer: Tokenizer, choices: Sequence[str]) -> None:
        self.inner = inner
        self.tokenizer = tokenizer
        self.choices = sorted({json.dumps(c, ensure_ascii=False)[1:-1] for c in choices})
        self._choice_set = set(self.choices)
        self.ids: list[int] = []
        self.text = ""
        self._pieces: dict[int, str] = {}

    def _piece(self, token: int) -> str:
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = str(self.tokenizer.decode([token], skip_special_tokens=False,
                                                                    clean_up_tokenization_spaces=False))
        return piece

    def _open_item(self) -> tuple[str, set[str]] | None:
        """The item being written (its text so far) and the items its list already holds; None outside an item."""
        match = _OPEN_ITEM.search(self.text)
        if match is None:
            return None
        start = self.text.rfind("[", 0, match.start() + 1)
        done = self.text[start + 1: match.start(1) - 1] if start >= 0 else ""
        return match.group(1), set(_ITEM.findall(done))

    def _leads_somewhere(self, prefix: str, piece: str, used: set[str]) -> bool:
        if "\ufffd" in piece:  # part of a character: it cannot be judged alone, so the grammar decides
            return True
        text = prefix + piece
        quote = _closing_quote(text, len(prefix))
        if quote is not None:  # the token ends the item: the item is what came before the quote
            return text[:quote] not in used and text[:quote] in self._choice_set
        return any(c.startswith(text) for c in self.choices if c not in used)

    def mask(self, logits: torch.Tensor) -> None:
        import torch

        self.inner.mask(logits)
        state = self._open_item()
        if state is None:
            return
        prefix, used = state
        if not used:
            return
        allowed = torch.isfinite(logits).nonzero().flatten().tolist()
        keep = [t for t in allowed if self._leads_somewhere(prefix, self._piece(t), used)]
        if not keep or len(keep) == len(allowed):
            return
        drop = torch.ones(logits.shape[-1], dtype=torch.bool, device=logits.device)
        drop[torch.tensor(keep, dtype=torch.long, device=logits.device)] = False
        logits.masked_fill_(drop, float("-inf"))

    def accept(self, token_id: int) -> None:
        self.inner.accept(token_id)
        self.ids.append(int(token_id))
        self.text = str(self.tokenizer.decode(self.ids, skip_special_tokens=True, clean_up_tokenization_spaces=False))

    def finished(self) -> bool:
        return self.inner.finished()


def _closing_quote(text: str, start: int) -> int | None:
    """The index of the first unescaped quote in ``text`` at or after ``start`` (the item's end), if any."""
    i = start
    while True:
        i = text.find('"', i)
        if i < 0:
            return None
        slashes = len(text[:i]) - len(text[:i].rstrip("\\"))
        if slashes % 2 == 0:
            return i
        i += 1
