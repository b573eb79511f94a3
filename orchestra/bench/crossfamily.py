"""Cross-family: a model with another tokenizer must be refused, with a typed error, before any mapping.

A tiny Llama with its own byte-level BPE tokenizer is built in a scratch folder (seconds, no
download). Two refusals are recorded: the mappings pair check (``TokenizerMismatchError``,
what ``orchestra calibrate`` hits) and the scheduler's family check (``CrossFamilyError``, what
``orchestra run`` hits for a pipeline that mixes families).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from orchestra.bench._context import BenchFamily

__all__ = ["CrossFamilyConfig", "Refusal", "CrossFamilySection", "run_crossfamily", "build_foreign_model"]

_FOREIGN_TEXT = (
    "Zebras graze while kestrels hover; quartz, jade and onyx glitter in the vaults of the old museum. "
    "Seventeen violins played a waltz at midnight, and the ferry crossed the fjord twice before dawn. "
) * 8


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CrossFamilyConfig(_Model):
    source: str = Field(description="alias of the family model the foreign model is paired with")
    vocab_size: int = Field(300, ge=260, description="vocabulary of the foreign byte-level BPE tokenizer")


class Refusal(_Model):
    check: str = Field(description="which check ran")
    refused: bool
    error_type: str | None
    message: str


class CrossFamilySection(_Model):
    config: CrossFamilyConfig
    foreign_model: str = Field(description="what the foreign model is")
    refusals: list[Refusal] = Field(default_factory=list)

    @property
    def all_refused(self) -> bool:
        return bool(self.refusals) and all(r.refused for r in self.refusals)


def build_foreign_model(folder: Path, vocab_size: int = 300) -> Path:
    """A random-initialised two-layer Llama and a freshly trained BPE tokenizer, saved as an HF folder."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_FOREIGN_TEXT], trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def run_crossfamily(config: CrossFamilyConfig, fam: BenchFamily, *, progress: bool = True) -> CrossFamilySection:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mappings.compat import check_pair
    from mappings.errors import MappingError
    from orchestra.errors import OrchestraError
    from orchestra.models.registry import ModelRegistry

    source = fam.loaded(config.source)
    with tempfile.TemporaryDirectory(prefix="orchestra-bench-foreign-") as tmp:
        folder = build_foreign_model(Path(tmp) / "foreign-llama", config.vocab_size)
        model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        section = CrossFamilySection(
            config=config, foreign_model=f"2-layer Llama, own byte-level BPE tokenizer ({len(tokenizer)} tokens)")
        checks = (
            ("mappings.compat.check_pair (orchestra calibrate / evaluate)",
             lambda: check_pair(source.model, source.tokenizer, model, tokenizer)),
            ("orchestra.models.registry.ModelRegistry.check_family (orchestra run)",
             lambda: ModelRegistry({**fam.aliases, "foreign": str(folder)}, family=fam.family,
                                   default_device="cpu").check_family(config.source)),
        )
        for name, check in checks:
            try:
                check()
            except (MappingError, OrchestraError) as exc:
                section.refusals.append(Refusal(check=name, refused=True, error_type=type(exc).__name__,
                                                message=str(exc)))
            else:
                section.refusals.append(Refusal(check=name, refused=False, error_type=None,
                                                message="accepted: a cross-family pair was NOT refused"))
    return section
