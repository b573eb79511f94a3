from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

DOCUMENT = (
    "The committee reviewed the annual report and found that revenue grew in every region. "
    "Costs fell as the new plant came online, and the board approved a dividend. "
    "Python functions return values; lists hold items in order and dictionaries map keys."
)

# The SmolLM2 chat template, used to exercise the chat-template path on the tiny tokenizer.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass
class Loaded:
    arch: str
    model: Any
    tokenizer: Any
    child_tokenizer: Any


_LOADED: dict[str, Loaded] = {}


@pytest.fixture(scope="session")
def tiny(tiny_family) -> Loaded:
    """The tiny parent model (float32, CPU) and the tokenizers of parent and child, loaded once per arch."""
    if tiny_family.arch not in _LOADED:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(tiny_family.parent, dtype=torch.float32).eval()
        _LOADED[tiny_family.arch] = Loaded(
            arch=tiny_family.arch,
            model=model,
            tokenizer=AutoTokenizer.from_pretrained(tiny_family.parent),
            child_tokenizer=AutoTokenizer.from_pretrained(tiny_family.child),
        )
    return _LOADED[tiny_family.arch]


@pytest.fixture(scope="session")
def llama_tiny(tiny_root) -> Loaded:
    """Only the llama tiny family: for tests whose point is not the architecture."""
    from tests.tiny_family import build_tiny_family

    if "llama" not in _LOADED:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        fam = build_tiny_family(tiny_root, "llama")
        model = AutoModelForCausalLM.from_pretrained(fam.parent, dtype=torch.float32).eval()
        _LOADED["llama"] = Loaded("llama", model, AutoTokenizer.from_pretrained(fam.parent),
                                  AutoTokenizer.from_pretrained(fam.child))
    return _LOADED["llama"]


@pytest.fixture(scope="session")
def smollm_root(real_family) -> Path:
    """The SmolLM2-135M-Instruct root model folder of the bundled family."""
    return Path(real_family.member_path("root"))
