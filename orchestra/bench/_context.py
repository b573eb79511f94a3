"""What every section shares: the family's models (loaded once), its mapping store and the held-out document."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, cast

from pydantic import BaseModel, ConfigDict, Field, field_validator

if TYPE_CHECKING:
    from mappings.models import ModelHandle
    from mappings.store import Mapping
    from orchestra.family.manifest import FamilyManifest
    from orchestra.familycache import FamilyCache
    from orchestra.familycache.mapping_store import MappingStore
    from orchestra.models.registry import LoadedModel, ModelRegistry

__all__ = ["Pair", "BenchFamily", "parse_pairs", "BUNDLED_ALIASES", "FORWARD_PAIRS", "REVERSE_PAIRS"]

# The bundled family by role: roles are stable across rebuilds, member names may not be.
BUNDLED_ALIASES = {"root": "root", "finetuned": "finetuned", "int8": "int8", "quantized": "quantized",
                   "distilled": "distilled"}
FORWARD_PAIRS = ("root>finetuned", "root>int8", "root>quantized", "root>distilled")
REVERSE_PAIRS = ("finetuned>root", "int8>root", "quantized>root", "distilled>root")


class Pair(BaseModel):
    """A source → target direction, by alias."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    source: str
    target: str

    @property
    def label(self) -> str:
        return f"{self.source}>{self.target}"

    @classmethod
    def parse(cls, text: str) -> Pair:
        parts = [p.strip() for p in text.replace("->", ">").split(">")]
        if len(parts) != 2 or not all(parts) or parts[0] == parts[1]:
            raise ValueError(f"pair {text!r} is not SOURCE>TARGET with two different aliases (e.g. root>finetuned)")
        return cls(source=parts[0], target=parts[1])

    @field_validator("source", "target")
    @classmethod
    def _nonempty(cls, value: str) -> str:
        if not value:
            raise ValueError("empty alias")
        return value


def parse_pairs(items: list[str] | tuple[str, ...]) -> list[Pair]:
    """Pairs from ``"a>b"`` strings, in order, without duplicates."""
    out: list[Pair] = []
    for item in items:
        for part in str(item).split(","):
            if part.strip():
                pair = Pair.parse(part)
                if pair not in out:
                    out.append(pair)
    return out


class ReverseCalibration(BaseModel):
    """A mapping the bench had to calibrate because the store lacked it."""

    model_config = ConfigDict(extra="forbid")
    pair: str
    path: str
    tokens: int
    seconds: float = Field(description="wall seconds of the on-demand calibration")


@dataclass
class BenchFamily:
    """Models by alias (loaded lazily, once), the mapping store the scheduler uses, and the held-out document.

    The registry and store are the scheduler's own classes, so a mapping the bench calibrates lands
    where a later ``orchestra run`` looks for it.
    """

    aliases: dict[str, str]
    registry: ModelRegistry
    store: MappingStore
    document: str
    document_name: str
    family: FamilyManifest | None = None
    device: str = "cpu"
    calibrated: list[ReverseCalibration] = field(default_factory=list)
    _handles: dict[str, ModelHandle] = field(default_factory=dict, repr=False)
    _mappings: dict[str, Mapping] = field(default_factory=dict, repr=False)
    _ids: list[int] | None = field(default=None, repr=False)

    # -- construction -----------------------------------------------------------------------------
    @classmethod
    def bundled(cls, home: str | os.PathLike[str] | None = None, device: str = "cpu",
                calibration_tokens: int | None = None) -> BenchFamily:
        """The bundled SmolLM2 family (already built) with its mapping store under ``<home>/mappings``."""
        from orchestra.family import load_family
        from orchestra.family.corpus import HELDOUT_TEXT, data_text

        family = load_family(home)
        # The bundled roles first (their order is the tables' order), then every other member the manifest lists
        # (e.g. one added after this code was written): by role, or by name when an earlier member has that role.
        first: dict[str, str] = {}
        for record in family.members.values():
            first.setdefault(record.role, record.name)
        aliases = {role: name for role, name in BUNDLED_ALIASES.items() if role in first}
        for record in family.members.values():
            alias = record.role if first[record.role] == record.name else record.name
            aliases.setdefault(alias, alias)
        return cls.from_models(aliases, Path(family.home) / "mappings", document=data_text(HELDOUT_TEXT),
                               document_name=HELDOUT_TEXT, family=family, device=device,
                               calibration_tokens=calibration_tokens)

    @classmethod
    def from_models(cls, aliases: dict[str, str], mapping_dir: str | Path, *, document: str, document_name: str,
                    family: FamilyManifest | None = None, device: str = "cpu", corpus: list[tuple[str, str]] | None = None,
                    calibration_tokens: int | None = None) -> BenchFamily:
        """Any models (family members or folders) by alias; ``corpus`` defaults to the family's calibration texts."""
        from orchestra.familycache.mapping_store import MappingStore
        from orchestra.models.registry import ModelRegistry

        registry = ModelRegistry(aliases, family=family, default_device=device)
        # the store's defaults are the scheduler's
        store = (MappingStore(Path(mapping_dir), corpus=corpus) if calibration_tokens is None else
                 MappingStore(Path(mapping_dir), corpus=corpus, tokens=calibration_tokens))
        return cls(aliases=dict(aliases), registry=registry, store=store, document=document,
                   document_name=document_name, family=family, device=device)

    # -- models -----------------------------------------------------------------------------------
    def loaded(self, alias: str) -> LoadedModel:
        return self.registry.load(alias)

    def handle(self, alias: str) -> ModelHandle:
        """A mappings ``ModelHandle`` sharing the registry's model (no second load, no re-hashing of weights)."""
        if alias not in self._handles:
            from mappings.fingerprint import Fingerprint, fingerprint_dir
            from mappings.models import ModelHandle

            lm = self.loaded(alias)
            fp = None
            if self.family is not None:
                try:
                    stored = self.family.member(self.aliases[alias]).fingerprint
                    fp = Fingerprint(stored["config"], stored["weights"], stored["tokenizer"])
                except Exception:  # a folder outside the family: hash it below
                    fp = None
            if fp is None or fp.combined != lm.info.fingerprint:
                fp = fingerprint_dir(lm.info.path)
            self._handles[alias] = ModelHandle(lm.model, lm.tokenizer, fp, lm.info.path)
        return self._handles[alias]

    def family_cache(self, source: str, **policy: object) -> FamilyCache:
        """A fresh FamilyCache over the bench's loaded models and mapping store (nothing cached yet).

        Gates are open by default: a bench section measures the map itself; the gates have their own tests.
        """
        from orchestra.familycache import CachePolicy, FamilyCache
        from orchestra.familycache.gates import GatePolicy

        policy.setdefault("gate", GatePolicy(offline=None, probe=None))
        policy.setdefault("min_mapped_tokens", 1)  # map even short prefixes: the map is what is measured
        return FamilyCache(self.registry, self.store, source=source, policy=CachePolicy(**policy))

    def max_positions(self, alias: str) -> int | None:
        return self.registry.info(alias).max_positions or None

    def model_bytes(self, alias: str) -> int:
        return self.registry.info(alias).weight_bytes

    # -- mappings ---------------------------------------------------------------------------------
    def mapping_path(self, pair: Pair) -> Path:
        return self.store.path_for(self.loaded(pair.source), self.loaded(pair.target))

    def mapping(self, pair: Pair, *, calibrate_missing: bool = True) -> Mapping:
        """The pair's stored mapping with its calibration statistics; calibrated into the store if missing."""
        import time
        import warnings

        if pair.label in self._mappings:
            return self._mappings[pair.label]
        from mappings.store import load_mapping
        from orchestra.errors import MappingUnavailableError

        source, target = self.loaded(pair.source), self.loaded(pair.target)
        path = self.store.path_for(source, target)
        if not (path / "manifest.json").is_file():
            if not calibrate_missing:
                raise MappingUnavailableError(f"no mapping for {pair.label} in {self.store.directory}")
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the store warns that it calibrates on demand: that is the point here
                self.store.get(source, target)
            self.calibrated.append(ReverseCalibration(pair=pair.label, path=str(path), tokens=self.store.tokens,
                                                      seconds=time.perf_counter() - t0))
        mapping = load_mapping(path, self.handle(pair.source).fingerprint, self.handle(pair.target).fingerprint,
                               device=target.device, with_stats=True)
        self._mappings[pair.label] = mapping
        return mapping

    # -- the document -----------------------------------------------------------------------------
    def document_ids(self) -> list[int]:
        """The held-out document's token ids (every alias shares the tokenizer: the registry checked)."""
        if self._ids is None:
            tok = self.loaded(next(iter(self.aliases))).tokenizer
            self._ids = list(tok(self.document, add_special_tokens=False)["input_ids"])
        return self._ids

    def tokens(self, n: int) -> tuple[list[int], bool]:
        """``n`` document tokens; when the document is shorter it wraps around (second value True)."""
        ids = self.document_ids()
        if n <= len(ids):
            return ids[:n], False
        out: list[int] = []
        while len(out) < n:
            out += ids[: n - len(out)]
        return out, True

    def text(self, n: int) -> str:
        """The document cut to about ``n`` tokens, as text (for agents, which tokenize it themselves)."""
        tok = self.loaded(next(iter(self.aliases))).tokenizer
        return cast(str, tok.decode(self.document_ids()[:n]))  # one id list: one str
