"""orchestra inside vLLM: the family's prefix cache through vLLM's KV connector API.

    from orchestra.vllm import connector_config
    LLM(model=member_folder, kv_transfer_config=KVTransferConfig(**connector_config(home, "finetuned")))

Owns the connector vLLM loads by module path (`orchestra.vllm.connector.FamilyConnector`), its scheduler
side (what the family's store can give a request: the member's own prefixes, or another member's mapped by
FamilyCache), its worker side (writing caches into vLLM's blocks and reading computed prompts out of them),
and the config that names it. Only ``orchestra.vllm.connector`` imports vLLM.

May import: ``orchestra.familycache``, ``orchestra.family.manifest``, ``orchestra.models`` and below.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestra._exports import lazy_exports

if TYPE_CHECKING:
    from orchestra.vllm._settings import ConnectorSettings
    from orchestra.vllm.config import connector_config, connector_json

__all__ = ["ConnectorSettings", "connector_config", "connector_json"]

__getattr__ = lazy_exports(
    __name__,
    {
        "orchestra.vllm._settings": ("ConnectorSettings",),
        "orchestra.vllm.config": ("connector_config", "connector_json"),
    },
)
