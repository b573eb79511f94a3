"""Do two tokenizers give the same token ids? What decides that, and a diff naming what differs.

Two family members can share one document cache only when the same text becomes the same ids on
both. That is decided by the vocabulary (token -> id), the model's segmentation rules (BPE merges,
WordPiece / Unigram settings and scores), the normalizer, the pre-tokenizer and the added tokens
(their ids and the flags that change how text is split around them). It is *not* decided by which
token is called eos or pad, by the chat template, by the post-processor (the BOS/EOS framing
``add_special_tokens=True`` adds) or by the decoder: a base checkpoint and its instruct checkpoint
differ only there and share token ids. A prompt framed differently by another chat template is a
different id sequence, which the cache compares by ids anyway (the scheduler prefills such a member
on its own).

`id_parts` is what `mappings.fingerprint.token_ids_digest` hashes; `compare_tokenizers` reads the
same parts, so ``diff.same_ids`` holds exactly when the two digests are equal.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mappings.types import Tokenizer

__all__ = ["TokenizerDiff", "compare_tokenizers", "id_parts", "first_difference"]

# Fixed text a slow tokenizer encodes for its digest: its splitting rules live in Python code and
# model files this module cannot read, so their effect on a varied text stands in for them.
_SLOW_PROBE = (
    "The quick brown fox jumps over the lazy dog. def parse(line):\n    return [int(x) for x in "
    "line.split(',')]  # 1234567890 ÄÖÜ ß 日本語 — “quotes” <tag> & co.\n\tTabs,  double  spaces; URLs: "
    "https://example.org/a?b=c. Numbers 3.14159 and 1e-9."
)
_EXAMPLES = 3  # tokens named per difference in a message


def _flags(token: Any) -> dict[str, bool]:
    """The flags of an added token that change how text is split around it (not its role).

    `token` is an entry of the backend's ``added_tokens`` (a dict) or a transformers ``AddedToken``.
    """
    def get(key: str) -> bool:
        return bool(token.get(key, False) if isinstance(token, Mapping) else getattr(token, key, False))

    return {key: get(key) for key in ("single_word", "lstrip", "rstrip", "normalized", "special")}


def _merge_key(merge: str | Sequence[str]) -> tuple[str, ...]:
    # tokenizers < 0.20 stores a merge as "a b", later versions as ["a", "b"]: one form for both
    return tuple(merge.split(" ", 1)) if isinstance(merge, str) else tuple(merge)


def _backend_state(tokenizer: Tokenizer) -> dict[str, Any] | None:
    """The fast tokenizer's full backend state (``tokenizer.json``'s content); None for a slow tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return json.loads(backend.to_str()) if backend is not None else None


def _parts(tokenizer: Tokenizer, state: Mapping[str, Any] | None) -> dict[str, Any]:
    if state is not None:
        model = dict(state.get("model") or {})
        merges = model.get("merges")
        if isinstance(merges, list) and any(isinstance(m, str) for m in merges[:1]):  # the old "a b" form
            model["merges"] = [list(_merge_key(m)) for m in merges]
        if isinstance(model.get("vocab"), dict):  # as (token, id) pairs in id order: hashed without sorting keys
            model["vocab"] = sorted(([str(k), int(v)] for k, v in model["vocab"].items()), key=lambda kv: (kv[1], kv[0]))
        added = sorted(({"id": int(t["id"]), "content": str(t["content"]), **_flags(t)}
                        for t in state.get("added_tokens") or []), key=lambda t: (t["id"], t["content"]))
        return {"kind": "fast", "model": model, "normalizer": state.get("normalizer"),
                "pre_tokenizer": state.get("pre_tokenizer"), "added_tokens": added}
    # A slow (pure-Python) tokenizer exposes no backend state: fall back to its vocabulary and added
    # tokens, plus the ids of a fixed probe text, which stand in for the merges and normalization
    # rules in its code and model files (two slow tokenizers with one vocabulary but other rules
    # would otherwise look the same).
    decoder: Mapping[int, Any] = getattr(tokenizer, "added_tokens_decoder", None) or {}
    slow_added = sorted(({"id": int(i), "content": str(t), **_flags(t)} for i, t in decoder.items()),
                        key=lambda t: (t["id"], t["content"]))
    try:
        probe = [int(i) for i in tokenizer(_SLOW_PROBE, add_special_tokens=False)["input_ids"]]
    except Exception:  # a tokenizer that cannot encode text on its own: vocabulary and added tokens only
        probe = []
    return {"kind": "slow", "model": {"vocab": dict(tokenizer.get_vocab())}, "normalizer": None,
            "pre_tokenizer": None, "added_tokens": slow_added, "probe_ids": probe}


def id_parts(tokenizer: Tokenizer) -> dict[str, Any]:
    """Everything that decides the token ids of a text, as plain JSON data (what the digest hashes).

    A fast tokenizer: its backend's model (vocabulary, merges or the model's equivalent, and the
    model's options), normalizer, pre-tokenizer and added tokens (id, content and splitting flags),
    read from ``backend_tokenizer.to_str()``; the post-processor, decoder, padding, truncation,
    special-token roles and chat template are left out (they frame or decode ids, never change them).
    """
    return _parts(tokenizer, _backend_state(tokenizer))


def first_difference(a: Sequence[object], b: Sequence[object]) -> int | None:
    """The first position where two sequences (of token ids, merges) differ (the shorter length if one extends the other); None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass(frozen=True)
class TokenizerDiff:
    """What differs between two tokenizers, split into what changes token ids and what does not.

    Sides are named by `names` (``a`` and ``b`` by default); every "x vs y" reads first side vs second.
    """

    names: tuple[str, str]
    """What the two sides are called in messages (e.g. ``("member chat", "the source")``)."""
    vocab_sizes: tuple[int, int]
    """Entries in each vocabulary (added tokens included)."""
    other_ids: int
    """Tokens in both vocabularies whose ids differ."""
    other_id_examples: tuple[tuple[str, int, int], ...]
    """The first few of them (by token): token, id in a, id in b."""
    only_in: tuple[tuple[str, ...], tuple[str, ...]]
    """A few tokens found only in a / only in b (their counts: ``only_counts``)."""
    only_counts: tuple[int, int]
    """How many tokens are only in a / only in b."""
    merges_differ: int
    """Merges in one tokenizer and not the other (BPE; 0 for other models)."""
    merge_order: int | None
    """Same merges, other priority: the first rank where the order differs (None: same order or merges differ)."""
    model: tuple[str, ...]
    """Differences of the segmentation model itself (its type, options, or scores), one line each."""
    normalizer: str | None
    """How the normalizers differ (None: the same)."""
    pre_tokenizer: str | None
    """How the pre-tokenizers differ (None: the same)."""
    added_tokens: tuple[str, ...]
    """Added tokens with another id, only on one side, or other splitting flags, one line each (all of them)."""
    notes: tuple[str, ...]
    """Differences that never change token ids: special-token roles, chat template, post-processor, decoder."""
    same_ids: bool
    """The same text gives the same ids on both (exactly when their `token_ids_digest`s are equal)."""

    @property
    def problems(self) -> list[str]:
        """Each difference that changes token ids, one short phrase each (empty when `same_ids`)."""
        a, b = self.names
        out: list[str] = []
        if self.vocab_sizes[0] != self.vocab_sizes[1]:
            out.append(f"vocabulary {self.vocab_sizes[0]} vs {self.vocab_sizes[1]}")
        if self.other_ids:
            examples = ", ".join(f"{tok!r} {i} vs {j}" for tok, i, j in self.other_id_examples)
            out.append(f"{self.other_ids:,} token{'s' if self.other_ids != 1 else ''} with other ids (e.g. {examples})")
        for side, count, tokens in ((a, self.only_counts[0], self.only_in[0]), (b, self.only_counts[1], self.only_in[1])):
            if count and self.vocab_sizes[0] == self.vocab_sizes[1]:  # unequal sizes already say so
                out.append(f"{count:,} token{'s' if count != 1 else ''} only in {side} (e.g. "
                           f"{', '.join(repr(t) for t in tokens)})")
        if self.merges_differ:
            out.append(f"{self.merges_differ:,} merge{'s' if self.merges_differ != 1 else ''} differ")
        elif self.merge_order is not None:
            out.append(f"merges in another order (first at rank {self.merge_order:,})")
        out.extend(self.model)
        if self.normalizer:
            out.append(f"normalizer {self.normalizer}")
        if self.pre_tokenizer:
            out.append(f"pre-tokenizer {self.pre_tokenizer}")
        out.extend(self.added_tokens[:_EXAMPLES])
        if len(self.added_tokens) > _EXAMPLES:
            rest = len(self.added_tokens) - _EXAMPLES
            out.append(f"{rest:,} more added-token difference{'s' if rest != 1 else ''}")
        if not self.same_ids and not out:  # defensive: the digests differ in a part described nowhere above
            out.append("the tokenization rules differ")
        return out

    def summary(self) -> str:
        """The id-changing differences on one line (``vocabulary 49152 vs 32000, 1,234 merges differ``)."""
        return ", ".join(self.problems) if self.problems else "same token ids"

    def refusal(self, member: str, source: str | None = None) -> str:
        """The one-line refusal: `member`'s tokenizer differs from the source's (named `source`), what differs, the rule."""
        named = f" ({source})" if source else ""
        return (f"{member}'s tokenizer differs from the source's{named}: {self.summary()} — members of one family "
                f"must share a tokenizer")


def _describe_part(a: object, b: object) -> str | None:
    """How two normalizer / pre-tokenizer states differ, for a message (None when equal)."""
    if a == b:
        return None

    def kind(x: object) -> str:
        if x is None:
            return "none"
        if isinstance(x, Mapping):
            inner = x.get("normalizers") or x.get("pretokenizers")
            if x.get("type") == "Sequence" and isinstance(inner, list):
                return "Sequence[" + ", ".join(kind(i) for i in inner) + "]"
            return str(x.get("type", "?"))
        return type(x).__name__

    ka, kb = kind(a), kind(b)
    if ka != kb:
        return f"{ka} vs {kb}"
    return f"{ka} with other settings"


def _model_differences(a: Mapping[str, Any], b: Mapping[str, Any], vocab_described: bool) -> tuple[str, ...]:
    ta, tb = a.get("type"), b.get("type")
    if ta != tb:
        return (f"model {ta or '?'} vs {tb or '?'}",)
    out = []
    for key in sorted((set(a) | set(b)) - {"type", "vocab", "merges"}):
        if a.get(key) != b.get(key):
            out.append(f"model option {key} {a.get(key)!r} vs {b.get(key)!r}")
    if a.get("vocab") != b.get("vocab") and not vocab_described:
        # Unigram keeps [piece, score] pairs: the same pieces and ids with other scores segment differently
        out.append("the model's vocabulary entries differ (e.g. Unigram scores)")
    return tuple(out)


def _added_differences(a: list[dict[str, Any]], b: list[dict[str, Any]], names: tuple[str, str]) -> tuple[str, ...]:
    by_a = {t["content"]: t for t in a}
    by_b = {t["content"]: t for t in b}
    out = []
    for content in sorted(set(by_a) | set(by_b)):
        ta, tb = by_a.get(content), by_b.get(content)
        if ta is None and tb is not None:
            out.append(f"added token {content!r} (id {tb['id']}) only in {names[1]}")
        elif tb is None and ta is not None:
            out.append(f"added token {content!r} (id {ta['id']}) only in {names[0]}")
        elif ta is not None and tb is not None and ta != tb:
            if ta["id"] != tb["id"]:
                out.append(f"added token {content!r} id {ta['id']} vs {tb['id']}")
            flags = [k for k in ta if k not in ("id", "content") and ta[k] != tb.get(k)]
            if flags:
                out.append(f"added token {content!r} splits differently ({', '.join(flags)} differ)")
    return tuple(out)


def _notes(a: Tokenizer, b: Tokenizer, sa: Mapping[str, Any] | None, sb: Mapping[str, Any] | None) -> tuple[str, ...]:
    """Differences that leave token ids alone (listed so a reader sees they were looked at)."""
    out = []
    ra = {k: str(v) for k, v in (getattr(a, "special_tokens_map", None) or {}).items()}
    rb = {k: str(v) for k, v in (getattr(b, "special_tokens_map", None) or {}).items()}
    for key in sorted(set(ra) | set(rb)):
        if ra.get(key) != rb.get(key):
            out.append(f"special-token role {key}: {ra.get(key)!r} vs {rb.get(key)!r}")
    ca, cb = getattr(a, "chat_template", None), getattr(b, "chat_template", None)
    if ca != cb:
        if not ca or not cb:
            out.append(f"chat template: {'present' if ca else 'none'} vs {'present' if cb else 'none'} "
                       "(prompts are compared by their ids)")
        else:
            out.append("chat templates differ (prompts are compared by their ids)")
    if sa is not None and sb is not None:
        if sa.get("post_processor") != sb.get("post_processor"):
            out.append("post-processors differ (the special tokens added around a sequence; prompts are compared "
                       "by their ids)")
        if sa.get("decoder") != sb.get("decoder"):
            out.append("decoders differ (how ids turn back into text)")
    return tuple(out)


def compare_tokenizers(a: Tokenizer, b: Tokenizer, *, names: tuple[str, str] = ("a", "b")) -> TokenizerDiff:
    """What differs between `a` and `b`: first what changes token ids (``same_ids`` is False when
    anything does), then, as notes, what never does (special-token roles, chat template, post-processor,
    decoder). `names` label the two sides in the messages.
    """
    sa, sb = _backend_state(a), _backend_state(b)
    pa, pb = _parts(a, sa), _parts(b, sb)
    va, vb = dict(a.get_vocab()), dict(b.get_vocab())
    both = sorted(set(va) & set(vb))
    moved = [(tok, va[tok], vb[tok]) for tok in both if va[tok] != vb[tok]]
    only_a, only_b = sorted(set(va) - set(vb)), sorted(set(vb) - set(va))
    ma, mb = pa.get("model") or {}, pb.get("model") or {}
    merges_a = [_merge_key(m) for m in ma.get("merges") or []]
    merges_b = [_merge_key(m) for m in mb.get("merges") or []]
    merges_differ = len(set(merges_a) ^ set(merges_b))
    merge_order: int | None = None
    if not merges_differ and merges_a != merges_b:  # the same merges at other ranks: BPE applies them in rank order
        merge_order = first_difference(merges_a, merges_b)
    vocab_described = bool(moved or only_a or only_b)
    return TokenizerDiff(
        names=names,
        vocab_sizes=(len(va), len(vb)),
        other_ids=len(moved),
        other_id_examples=tuple(moved[:_EXAMPLES]),
        only_in=(tuple(only_a[:_EXAMPLES]), tuple(only_b[:_EXAMPLES])),
        only_counts=(len(only_a), len(only_b)),
        merges_differ=merges_differ,
        merge_order=merge_order,
        model=_model_differences(ma, mb, vocab_described) if pa["kind"] == pb["kind"] == "fast" else (),
        normalizer=_describe_part(pa.get("normalizer"), pb.get("normalizer")),
        pre_tokenizer=_describe_part(pa.get("pre_tokenizer"), pb.get("pre_tokenizer")),
        added_tokens=_added_differences(pa["added_tokens"], pb["added_tokens"], names),
        notes=_notes(a, b, sa, sb),
        same_ids=pa == pb,
    )
