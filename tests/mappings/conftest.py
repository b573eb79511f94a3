"""Fixtures for the mappings tests: corpora, loaded tiny models, calibrated tiny mappings, extra pairs."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.tiny_family import TinyFamily, build_tiny_family, make_config, make_tokenizer

DATA = Path(__file__).resolve().parents[2] / "orchestra" / "family" / "data"

# Small calibration budget: enough for the tiny models, seconds per pair.
TOKENS = 1024
WINDOW = 64


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    """Tiny models run fastest on one thread; two threads on a busy 2-core machine can be 100x slower."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def corpus() -> list[tuple[str, str]]:
    """Two license texts: the first is fitted on, the second is held out."""
    return [(name, (DATA / name).read_text(encoding="utf-8")) for name in ("apache-2.0.txt", "mpl-2.0.txt")]


@pytest.fixture(scope="session")
def document() -> str:
    """An evaluation document the calibration never sees."""
    return (DATA / "gpl-3.txt").read_text(encoding="utf-8")


_MODELS: dict[str, object] = {}


def load(path: Path):
    """Load (once per session) a tiny model folder in eval mode."""
    from transformers import AutoModelForCausalLM

    key = str(path)
    if key not in _MODELS:
        _MODELS[key] = AutoModelForCausalLM.from_pretrained(key).eval()
    return _MODELS[key]


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


@dataclass
class TinyMapping:
    family: TinyFamily
    mapping: object
    path: Path


@pytest.fixture(scope="session")
def tiny_mapping(tiny_family, corpus, tmp_path_factory) -> TinyMapping:
    """The default (auto) mapping parent -> child for each tiny architecture, saved to disk."""
    from mappings.calibrate import CalibrationSettings, calibrate

    settings = CalibrationSettings(tokens=TOKENS, window=WINDOW)
    mapping = calibrate(tiny_family.parent, tiny_family.child, corpus, settings, progress=False)
    out = tmp_path_factory.mktemp(f"map_{tiny_family.arch}")
    mapping.save(out)
    return TinyMapping(tiny_family, mapping, out)


@pytest.fixture(scope="session")
def llama_family(tiny_root) -> TinyFamily:
    return build_tiny_family(tiny_root, "llama")


@pytest.fixture(scope="session")
def qwen2_family(tiny_root) -> TinyFamily:
    return build_tiny_family(tiny_root, "qwen2")


def save_variant(model, tokenizer, out: Path) -> Path:
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def theta_variant(llama_family, tmp_path_factory) -> Path:
    """The llama parent's exact weights with RoPE base 1000 instead of 10000."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("theta_variant")
    config = json.loads((llama_family.parent / "config.json").read_text())
    parent = load(llama_family.parent)
    cfg = parent.config.__class__.from_dict({**config, "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0}})
    model = AutoModelForCausalLM.from_config(cfg)
    model.load_state_dict(parent.state_dict())
    return save_variant(model.eval(), load_tokenizer(llama_family.parent), out)


@pytest.fixture(scope="session")
def head_dim_variant(tmp_path_factory) -> Path:
    """A random llama with head size 8 (the tiny llama has 16) and the shared tokenizer."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("head_dim_variant")
    tok = make_tokenizer()
    cfg = make_config("llama", len(tok))
    cfg.head_dim = 8
    torch.manual_seed(3)
    return save_variant(AutoModelForCausalLM.from_config(cfg).eval(), tok, out)


@pytest.fixture(scope="session")
def mha_variant(tmp_path_factory) -> Path:
    """A random 3-layer llama with multi-head attention (4 KV heads; the tiny llama has 4 layers, 2 KV heads)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("mha_variant")
    tok = make_tokenizer()
    cfg = make_config("llama", len(tok))
    cfg.num_key_value_heads = 4
    cfg.num_hidden_layers = 3
    torch.manual_seed(5)
    return save_variant(AutoModelForCausalLM.from_config(cfg).eval(), tok, out)


@pytest.fixture(scope="session")
def pruned_variant(llama_family, tmp_path_factory) -> Path:
    """The llama parent with decoder layer 2 removed (target layers 0, 1, 2 are parent layers 0, 1, 3)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("pruned_variant")
    model = AutoModelForCausalLM.from_pretrained(str(llama_family.parent)).eval()
    keep = [0, 1, 3]
    model.model.layers = torch.nn.ModuleList([model.model.layers[i] for i in keep])
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.layer_idx = i
    model.config.num_hidden_layers = len(keep)
    return save_variant(model, load_tokenizer(llama_family.parent), out)


@pytest.fixture(scope="session")
def other_tokenizer_model(tmp_path_factory) -> Path:
    """A tiny llama whose tokenizer has a smaller vocabulary (another 'family')."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("other_tokenizer")
    tok = make_tokenizer(vocab_size=300)
    torch.manual_seed(4)
    return save_variant(AutoModelForCausalLM.from_config(make_config("llama", len(tok))).eval(), tok, out)
