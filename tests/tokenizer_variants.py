"""Tokenizer variants of a saved model for the tokenizer-compatibility tests: an "instruct" sibling, edited
copies, a tokenizer of another kind, and a model folder that pairs a model's weights with any of them."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

__all__ = ["CHAT_TEMPLATE", "save_instruct_tokenizer", "save_edited_tokenizer", "swap_ids", "wordlevel_tokenizer",
           "model_folder"]

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
"""A chat template whose head does not depend on the content: prompts on it use the chat-native layout."""


def save_instruct_tokenizer(source: Path, out: Path, *, eos_token: str = "<pad>", pad_token: str = "</s>",
                            chat_template: str | None = CHAT_TEMPLATE) -> Path:
    """The source's tokenizer as an instruct checkpoint ships it: other eos/pad roles and a chat template."""
    tok = AutoTokenizer.from_pretrained(str(source), eos_token=eos_token, pad_token=pad_token)
    tok.chat_template = chat_template
    tok.save_pretrained(str(out))
    return out


def save_edited_tokenizer(source: Path, out: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    """The source's tokenizer with its backend state (``tokenizer.json``) changed by `edit`, same special tokens."""
    tok = AutoTokenizer.from_pretrained(str(source))
    state = json.loads(tok.backend_tokenizer.to_str())
    edit(state)
    edited = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(state)),
                                     **{k: str(v) for k, v in tok.special_tokens_map.items()})
    edited.save_pretrained(str(out))
    return out


def swap_ids(a: str, b: str) -> Callable[[dict[str, Any]], None]:
    """An edit exchanging the ids of two vocabulary tokens (the merges, being strings, stay as they are)."""
    def edit(state: dict[str, Any]) -> None:
        vocab = state["model"]["vocab"]
        vocab[a], vocab[b] = vocab[b], vocab[a]

    return edit


def wordlevel_tokenizer(words: int = 40) -> PreTrainedTokenizerFast:
    """A tokenizer of another kind altogether: whitespace-split words, one id each."""
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": 4 + i for i in range(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")


def model_folder(model_dir: Path, out: Path, save_tokenizer: Callable[[Path], object]) -> Path:
    """A model folder with `model_dir`'s config and weights and the tokenizer `save_tokenizer(out)` writes."""
    out.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.name in ("config.json", "generation_config.json") or f.suffix == ".safetensors":
            shutil.copy2(f, out / f.name)
    save_tokenizer(out)
    return out
