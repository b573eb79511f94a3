"""Settings of the chat backend: where the family lives, devices, gates, generation limits."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from orchestra import GatePolicy

__all__ = ["ChatConfig", "DEFAULT_SYSTEM_PROMPT"]

DEFAULT_SYSTEM_PROMPT = "You answer questions about the document above. Be brief and factual."


class ChatConfig(BaseModel):
    """Everything the engine needs; `from_env` reads the ORCHESTRA_CHAT_* variables for `uvicorn` starts."""

    model_config = ConfigDict(extra="forbid")

    home: Path | None = Field(None, description="Family home (default: $ORCHESTRA_HOME or ~/.cache/orchestra).")
    source: str = Field("root", description="Family member (role or name) that prefills every document.")
    device: str = Field("auto", description="'cpu', 'cuda:N' or 'auto' for every model.")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    gate: GatePolicy = Field(default_factory=GatePolicy, description="Gates for mapped caches (offline, probe, shadow).")
    tail_tokens: int = Field(32, ge=2, description="Trailing tokens recomputed on the target after mapping.")
    cache_budget_mb: int = Field(4096, ge=1, description="Memory the FamilyCache may hold (K/V of every member).")
    mapping_dir: Path | None = Field(None, description="Mapping store folder (default: <family home>/mappings).")
    on_missing_mapping: Literal["refuse", "calibrate"] = Field(
        "refuse",
        description="A missing mapping re-prefills (refuse) or is calibrated inside the request (minutes).",
    )
    default_max_new_tokens: int = Field(128, ge=1)
    max_new_tokens_limit: int = Field(1024, ge=1, description="Largest max_new_tokens a request may ask for.")
    max_document_chars: int = Field(400_000, ge=1, description="Larger uploads are refused with 413.")
    system_prompt: str = DEFAULT_SYSTEM_PROMPT

    @classmethod
    def from_env(cls) -> ChatConfig:
        """ORCHESTRA_HOME, ORCHESTRA_CHAT_DEVICE, ORCHESTRA_CHAT_SOURCE, ORCHESTRA_CHAT_ON_MISSING_MAPPING."""
        values: dict[str, object] = {}
        if os.environ.get("ORCHESTRA_HOME"):
            values["home"] = os.environ["ORCHESTRA_HOME"]
        for key in ("device", "source", "on_missing_mapping"):
            env = os.environ.get(f"ORCHESTRA_CHAT_{key.upper()}")
            if env:
                values[key] = env
        return cls.model_validate(values)
