"""A family of the user's own models: `orchestra family init NAME MODEL...` writes its manifest into a home.

Each model is a folder or a Hugging Face Hub id (``org/name[@revision]``, `orchestra.models.modelref`),
optionally named (``instruct=Qwen/Qwen2.5-0.5B-Instruct``). The source (``--source``, else the
first model) becomes the member with role ``root``: the one whose cache is mapped into the others,
what ``orchestra family calibrate`` calibrates from. Nothing is copied: a member record points at
the folder or the Hub-cache snapshot, with the fingerprint computed once here (so later runs never
hash weights), its layer and parameter counts read from the files' headers, and how it was named
(``made_by``), so that `load_family` can check the files are still the ones recorded and say how to
re-initialise when they are not. Members must give the same token ids (vocabulary, merges,
normalisation, added tokens: `mappings.tokenizer_compat`); special-token roles and chat templates
may differ, as between a base checkpoint and its instruct sibling.

`orchestra run`, `serve`, `bench` and `Pipeline(family=)` then take this home as they take the
bundled family's (`--home` or ``$ORCHESTRA_HOME``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from orchestra.errors import CrossFamilyError, FamilyError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from orchestra.family.manifest import FamilyManifest, MemberRecord
    from orchestra.models.modelref import ResolvedModel

__all__ = ["MemberArg", "parse_member_arg", "init_family", "home_for_models"]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class MemberArg:
    """One MODEL argument of `family init`: a member name (None: derived) and a model reference."""

    name: str | None
    reference: str


def parse_member_arg(text: str) -> MemberArg:
    """``name=reference`` or a bare reference (a Hub id or a folder never starts with ``word=``)."""
    head, sep, tail = text.partition("=")
    if sep and _NAME.match(head) and tail:
        return MemberArg(head, tail)
    return MemberArg(None, text)


def _default_name(reference: str, path: Path, repo_id: str | None) -> str:
    base = repo_id.split("/")[-1] if repo_id is not None else path.name
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", base).strip("-.").lower()
    return name or "model"


def init_family(name: str, models: Sequence[str], *, home: str | os.PathLike[str] | None = None,
                source: str | None = None, force: bool = False) -> FamilyManifest:
    """Write ``<home>/family/family.json`` for `models`; returns the `FamilyManifest` (as `load_family` reads it).

    Refused (typed, one line) when a family is already there (unless `force`), when two members share a
    name, when `source` names none of them, or when a member's token ids differ from the source's.
    """
    from transformers import AutoTokenizer

    from orchestra.family.manifest import MANIFEST_NAME, FamilyManifest, family_dir
    from orchestra.models.modelref import ModelRef
    from orchestra.paths import resolve_home

    if not _NAME.match(name):
        raise FamilyError(f"family name {name!r} must be letters, digits, '.', '_' or '-': pick another")
    if not models:
        raise FamilyError("give at least one model: `orchestra family init NAME MODEL...`")
    home_path = resolve_home(home)
    target = family_dir(home_path) / MANIFEST_NAME
    if target.exists() and not force:
        raise FamilyError(f"a family is already at {target.parent}: pass --force to replace its manifest, or "
                          "--home for another home")
    args = [parse_member_arg(m) for m in models]
    resolved = [ModelRef.parse(a.reference).resolve() for a in args]
    names = _member_names(args, resolved)
    src = _source_index(names, source)
    tokenizers = [AutoTokenizer.from_pretrained(str(r.path)) for r in resolved]
    _check_token_ids(tokenizers, names, src)
    records = {names[i]: _member_record(names[i], None if i == src else names[src], arg, res, tok)
               for i, (arg, res, tok) in enumerate(zip(args, resolved, tokenizers, strict=True))}
    manifest = FamilyManifest(family=name, home=str(home_path), members=records)
    target.parent.mkdir(parents=True, exist_ok=True)
    manifest.save(target)
    return FamilyManifest.load(target)


def home_for_models(models: Sequence[str], *, under: str | os.PathLike[str] | None = None,
                    source: str | None = None) -> Path:
    """A family home of `models` (``orchestra serve MODEL...`` without a prior ``family init``): initialised once
    under ``<home>/served/<key>``, then reused while the recorded files are the same (fingerprints are not
    computed again); re-initialised when a folder's files changed. The key is the references as given (a folder
    by its absolute path), with the source."""
    import hashlib
    import json

    from orchestra.family.manifest import load_family
    from orchestra.paths import resolve_home

    if not models:
        raise FamilyError("give at least one model (a folder or a Hub id)")
    args = [parse_member_arg(m) for m in models]
    refs = [(a.name, str(Path(a.reference).expanduser().resolve()) if Path(a.reference).expanduser().exists()
             else a.reference) for a in args]
    key = hashlib.sha256(json.dumps({"models": refs, "source": source}).encode()).hexdigest()[:16]
    home = resolve_home(under) / "served" / key
    try:
        load_family(home)
        return home
    except FamilyError:  # none yet, or its files changed since: (re)initialise
        init_family("served", models, home=home, source=source, force=True)
        return home


def _member_names(args: list[MemberArg], resolved: list[ResolvedModel]) -> list[str]:
    """Each model's member name, given or derived; refused when two would share one."""
    names = [a.name or _default_name(a.reference, r.path, r.ref.repo_id)
             for a, r in zip(args, resolved, strict=True)]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise FamilyError(f"two models would both be named {duplicates[0]!r}: name them, e.g. "
                          f"`{duplicates[0]}-a=<model>`")
    return names


def _source_index(names: list[str], source: str | None) -> int:
    """Which member is the root: the one `source` names, else the first; refused when it names none."""
    if source is not None and source not in names:
        raise FamilyError(f"--source {source!r} is none of the members ({', '.join(names)}): "
                          "give one of them")
    return names.index(source) if source is not None else 0


def _check_token_ids(tokenizers: Sequence[PreTrainedTokenizerBase], names: list[str], src: int) -> None:
    """Refuse, saying how they differ, a member whose token ids differ from the source's."""
    from mappings.fingerprint import token_ids_digest
    from mappings.tokenizer_compat import compare_tokenizers

    root_ids = token_ids_digest(tokenizers[src])
    for i, tok in enumerate(tokenizers):
        if i != src and token_ids_digest(tok) != root_ids:
            diff = compare_tokenizers(tok, tokenizers[src],
                                      names=(f"member {names[i]}", f"the source {names[src]}"))
            raise CrossFamilyError(diff.refusal(f"member {names[i]}", names[src])
                                   + f": leave {names[i]!r} out of this family")


def _member_record(name: str, parent: str | None, arg: MemberArg, res: ResolvedModel,
                   tok: PreTrainedTokenizerBase) -> MemberRecord:
    """A member's record (the root's without a `parent`): its place, naming, fingerprint and sizes."""
    from orchestra.family.manifest import MemberRecord
    from orchestra.models.registry import parameter_count, read_model_config

    params = parameter_count(res.path)
    size = sum(f.stat().st_size for f in res.path.glob("*.safetensors"))
    made_by: dict[str, object] = {"kind": "hub" if res.ref.is_hub else "folder", "reference": arg.reference}
    if res.commit is not None:
        made_by["commit"] = res.commit
    return MemberRecord(
        name=name, role="root" if parent is None else "external", path=str(res.path),
        parent=parent, made_by=made_by, fingerprint=res.fingerprint(tok).as_dict(),
        num_layers=int(read_model_config(res.path)[1].get("num_hidden_layers", 0)), num_parameters=params,
        bytes=size,
    )
