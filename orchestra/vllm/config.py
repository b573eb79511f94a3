"""The ``--kv-transfer-config`` that puts orchestra's family cache into a vLLM engine of one member."""

from __future__ import annotations

import json
from typing import Any

from orchestra.vllm._settings import ConnectorSettings

__all__ = ["connector_config", "connector_json"]


def connector_config(home: str, member: str, **settings: Any) -> dict[str, Any]:
    """vLLM's ``KVTransferConfig`` fields for `member` of the family at `home` (settings: `ConnectorSettings`)."""
    extra = ConnectorSettings(home=str(home), member=member, **settings).model_dump(exclude_none=True)
    return {
        "kv_connector": "FamilyConnector",
        "kv_connector_module_path": "orchestra.vllm.connector",
        "kv_role": "kv_both",
        # a load that fails is recomputed by the engine, never served half-written
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def connector_json(home: str, member: str, **settings: Any) -> str:
    """`connector_config` as the JSON ``vllm serve --kv-transfer-config`` takes."""
    return json.dumps(connector_config(home, member, **settings))
