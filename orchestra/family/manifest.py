"""The family manifest (`family.json`): what each member is, where it lives, how far it is from the root."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from orchestra.errors import FamilyError, FamilyHomeError, MemberNotFoundError
from orchestra.paths import resolve_home

__all__ = ["Divergence", "MemberRecord", "FamilyManifest", "Role", "MANIFEST_NAME", "MEMBER_MARKER", "family_dir",
           "load_family", "EXTERNAL_KINDS"]

MANIFEST_NAME = "family.json"
MEMBER_MARKER = "member.json"
EXTERNAL_KINDS = ("hub", "folder")
"""``made_by["kind"]`` of a member of a family of one's own (`orchestra family init`): it lives outside the
home (a folder, or a snapshot in the Hugging Face cache) and nothing of it is copied there."""
# One role per bundled member: pipelines, the cache and the server address members by role, so two
# members never share one ("quantized" is the 4-bit member, "int8" the int8 per-channel one).
Role = Literal["root", "finetuned", "quantized", "int8", "distilled", "external"]


class Divergence(BaseModel):
    """How far a member's next-token distribution is from the root's on held-out text."""

    model_config = ConfigDict(extra="forbid")
    text: str = Field(description="name of the held-out text")
    tokens: int = Field(description="number of next-token positions compared")
    kl: float = Field(description="mean KL(root || member) per position, nats")
    top1: float = Field(description="fraction of positions where both pick the same top-1 token")


class MemberRecord(BaseModel):
    """One family member."""

    model_config = ConfigDict(extra="forbid")
    name: str
    role: Role
    path: str
    parent: str | None = None
    made_by: dict[str, object] = Field(default_factory=dict, description="the recipe that produced it")
    fingerprint: dict[str, str] = Field(description="sha256 of config, weights, tokenizer and combined")
    num_layers: int
    num_parameters: int
    bytes: int = Field(description="size of the weight files on disk")
    divergence: Divergence | None = None


class FamilyManifest(BaseModel):
    """The whole family, as written to ``<home>/family/family.json``."""

    model_config = ConfigDict(extra="forbid")
    family: str = "smollm2"
    home: str
    members: dict[str, MemberRecord]

    def member(self, key: str) -> MemberRecord:
        """Look a member up by name or by role (``root``, ``finetuned``, ``quantized``, ``int8``, ``distilled``)."""
        if key in self.members:
            return self.members[key]
        for record in self.members.values():
            if record.role == key:
                return record
        raise MemberNotFoundError(
            f"no family member named or with role {key!r}; known: "
            + ", ".join(f"{r.name} ({r.role})" for r in self.members.values())
        )

    def member_path(self, key: str) -> Path:
        return Path(self.member(key).path)

    @classmethod
    def load(cls, path: Path) -> FamilyManifest:
        """Read ``family.json``; its paths are resolved against the home it is in now (moved or copied homes work)."""
        path = Path(path)
        return cls.model_validate_json(path.read_text(encoding="utf-8")).located(path.resolve().parent.parent)

    def located(self, home: Path) -> FamilyManifest:
        """This manifest with `home` set to where it is and every member path resolved against it.

        Paths are stored relative to the home; an absolute path under the home it was written in (written by
        an older version) is moved along with it, so a copy never reads or writes the original location.
        """
        home = Path(home)
        written = Path(self.home) if self.home and Path(self.home).is_absolute() else None
        members = {}
        for name, record in self.members.items():
            where = Path(record.path)
            if not where.is_absolute():
                where = home / where
            elif written is not None and where.is_relative_to(written):
                where = home / where.relative_to(written)
            members[name] = record.model_copy(update={"path": str(where)})
        return self.model_copy(update={"home": str(home), "members": members})

    def save(self, path: Path) -> None:
        """Write ``family.json`` crash-safely, with every path inside the home stored relative to it."""
        payload = self.model_dump(mode="json")
        home = Path(self.home)
        payload["home"] = "."
        for record in payload["members"].values():
            record["path"] = home_relative(record["path"], home)
        write_json_atomic(path, payload, step="family.json")


def home_relative(path: str | os.PathLike[str], home: Path) -> str:
    """`path` relative to `home` when it lies inside it (POSIX separators), else unchanged."""
    where = Path(path)
    if where.is_absolute() and where.is_relative_to(home):
        return where.relative_to(home).as_posix()
    return str(path)


def write_json_atomic(path: Path, payload: object, *, step: str | None = None) -> None:
    """Write JSON next to its destination, then rename, so a reader never sees half a file."""
    from mappings.atomic import write_atomic

    write_atomic(path, json.dumps(payload, indent=2) + "\n", step=step)


def family_dir(home: Path) -> Path:
    """Where the family lives under an orchestra home."""
    return home / "family"


def _read_valid_record(member_dir: Path) -> MemberRecord | None:
    """The member in `member_dir` (its path: where it is now), or None when it is missing or incomplete."""
    marker = member_dir / MEMBER_MARKER
    if not marker.is_file() and not member_dir.exists():
        from mappings.atomic import recover_dir

        recover_dir(member_dir)  # a replace cut short between its two renames (no atomic swap on this platform)
    if not marker.is_file():
        return None
    try:
        record = MemberRecord.model_validate_json(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    weights = sorted(member_dir.glob("*.safetensors"))
    if not weights or sum(p.stat().st_size for p in weights) != record.bytes:
        return None
    return record.model_copy(update={"path": str(member_dir.resolve())})


def load_family(home: str | os.PathLike[str] | None = None) -> FamilyManifest:
    """Read an already-built family; raise a typed error saying how to build it otherwise.

    Lives here, not in :mod:`orchestra.family.build`, so that running pipelines on a built family
    never imports the build and training code (or gguf and peft behind it).
    """
    home_path = resolve_home(home, writable=False)  # reading needs no write access (a read-only home works)
    manifest_path = family_dir(home_path) / MANIFEST_NAME
    if not manifest_path.is_file():
        raise FamilyError(f"no family at {family_dir(home_path)}; run `orchestra family build --home {home_path}`")
    try:
        manifest = FamilyManifest.load(manifest_path)
    except (ValueError, UnicodeDecodeError) as exc:
        raise FamilyError(f"{manifest_path} is corrupt ({exc}); run `orchestra family build --force`") from exc
    except OSError as exc:
        raise FamilyHomeError(f"cannot read {manifest_path}: {exc.strerror or exc}; check the family home's "
                              "permissions or pass --home") from exc
    for record in manifest.members.values():
        if record.made_by.get("kind") in EXTERNAL_KINDS:
            problem = _external_problem(Path(record.path), record.bytes)
            if problem is not None:
                raise FamilyError(f"family member {record.name}: {problem}; run `orchestra family init "
                                  f"{manifest.family} ... --force --home {home_path}` again")
            continue
        if _read_valid_record(Path(record.path)) is None:
            raise FamilyError(
                f"family member {record.name} at {record.path} is missing or incomplete; "
                f"run `orchestra family build --home {home_path}`"
            )
    return manifest


def _external_problem(path: Path, recorded_bytes: int) -> str | None:
    """Why a member living outside the home no longer matches its record (None: it does)."""
    if not (path / "config.json").is_file():
        return f"{path} is gone or has no config.json"
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    if size != recorded_bytes:
        return f"its weights at {path} changed ({size} bytes, {recorded_bytes} recorded)"
    return None
