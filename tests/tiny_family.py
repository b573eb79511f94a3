"""Tiny model families for fast tests: seconds to build, no download.

Each family is a random-initialised parent, briefly trained so its outputs have structure, and a
child derived from it by a few more training steps on other text, saved as normal HF folders
with a shared byte-level BPE tokenizer. Three layouts are covered so every capture and injection
path runs on more than one cache shape:

- ``llama``: grouped-query attention (4 query heads, 2 KV heads), no biases;
- ``qwen2``: multi-head attention (4 KV heads) with q/k/v biases;
- ``mistral``: GQA with 6 query heads over 2 KV heads and a different RoPE base.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

ARCHITECTURES = ("llama", "qwen2", "mistral")

_TEXT_A = (
    "The committee reviewed the annual report and found that revenue grew in every region. "
    "Costs fell as the new plant came online, and the board approved a dividend. "
) * 20
_TEXT_B = (
    "def parse(line):\n    return [int(x) for x in line.split(',')]\n"
    "Python functions return values; lists hold items in order and dictionaries map keys. "
) * 20


def make_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_TEXT_A, _TEXT_B], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def make_config(arch: str, vocab_size: int):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
    )
    if arch == "llama":
        return LlamaConfig(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           rope_theta=10000.0, **common)
    if arch == "qwen2":
        return Qwen2Config(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                           rope_theta=10000.0, **common)
    if arch == "mistral":
        return MistralConfig(num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                             hidden_size=96, intermediate_size=192, vocab_size=vocab_size,
                             max_position_embeddings=512, rope_theta=50000.0, sliding_window=None,
                             bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    raise ValueError(f"unknown tiny architecture {arch!r}; use one of {ARCHITECTURES}")


def _train(model, tokenizer, text: str, steps: int, lr: float, seed: int) -> None:
    torch.manual_seed(seed)
    ids = torch.tensor(tokenizer(text)["input_ids"])
    window = 64
    n = len(ids) // window
    data = ids[: n * window].view(n, window)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        batch = data[torch.randint(0, n, (4,), generator=gen)]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()


@dataclass(frozen=True)
class TinyFamily:
    arch: str
    parent: Path
    child: Path


def build_tiny_family(root: Path, arch: str, seed: int = 0, head_dim: int | None = None) -> TinyFamily:
    """Build (or reuse) a parent and a child under ``root/arch``.

    `head_dim` overrides the layout's (vLLM's CPU attention kernels need a multiple of 32)."""
    parent_dir, child_dir = root / arch / "parent", root / arch / "child"
    if (child_dir / "config.json").exists():
        return TinyFamily(arch, parent_dir, child_dir)
    tokenizer = make_tokenizer()
    torch.manual_seed(seed)
    config = make_config(arch, len(tokenizer))
    if head_dim is not None:
        config.head_dim = head_dim
    parent = AutoModelForCausalLM.from_config(config)
    _train(parent, tokenizer, _TEXT_A + _TEXT_B, steps=40, lr=3e-3, seed=seed)
    parent.save_pretrained(parent_dir)
    tokenizer.save_pretrained(parent_dir)
    _train(parent, tokenizer, _TEXT_B, steps=15, lr=1e-3, seed=seed + 1)
    parent.save_pretrained(child_dir)
    tokenizer.save_pretrained(child_dir)
    return TinyFamily(arch, parent_dir, child_dir)


def build_tiny_home(scratch: Path, context: int = 4096) -> Path:
    """A family home laid out by `build_family` (the bundled family's members and roles), its members derived
    from a freshly trained tiny llama whose context is raised to `context` positions (RoPE takes more than the
    512 it was made with; long documents and the report agent need them). Used by the CI's demo smoke run and
    by the test that runs the docs' examples."""
    import json

    fam = build_tiny_family(scratch / "tiny", "llama")
    config_file = Path(fam.parent) / "config.json"
    config = json.loads(config_file.read_text())
    config["max_position_embeddings"] = context
    config_file.write_text(json.dumps(config, indent=2))
    return build_home_from(fam.parent, scratch / "home")  # a first mapped request calibrates it; later ones reuse it


def build_home_from(parent: Path, home: Path) -> Path:
    """`build_family` into `home` with every member derived from the tiny model at `parent` (not the GGUF), and
    an empty mapping store (what needs a map calibrates it)."""
    from orchestra.family import build_family
    from tests.fault_driver import tiny_build_patches

    patches = tiny_build_patches(parent)
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        build_family(home, calibrate=False)
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)
    return home
