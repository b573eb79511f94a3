"""`FamilyConnector`: orchestra's family cache as a vLLM KV connector, loaded by module path.

    vllm serve <member folder> --kv-transfer-config '{"kv_connector": "FamilyConnector",
        "kv_connector_module_path": "orchestra.vllm.connector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"home": "<family home>", "member": "<member>"}}'

(`orchestra.vllm.connector_config` writes that JSON.) Every engine of a family shares one store: an engine
saves the prompts it computes under its member's exact namespace, loads its own stored prefixes, and loads
a prefix another member computed mapped into its member by orchestra's FamilyCache, gated, with exact sinks
and a recomputed tail. The scheduler side is `SchedulerSide`, the worker side `WorkerSide`; this class only
routes vLLM's calls to them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from orchestra.vllm._plan import StepPlan
from orchestra.vllm._settings import ConnectorSettings

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from orchestra.vllm._scheduler import SchedulerSide
    from orchestra.vllm._worker import WorkerSide

__all__ = ["FamilyConnector", "FamilyMetadata"]


class FamilyMetadata(KVConnectorMetadata):
    """One step's plan, from the scheduler to the workers."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class FamilyConnector(KVConnectorBase_V1):
    """A family-wide prefix cache for one vLLM engine of a family member."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        settings = ConnectorSettings.model_validate(self._kv_transfer_config.kv_connector_extra_config)
        block_size = vllm_config.cache_config.block_size
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            from vllm.utils.hashing import get_hash_fn_by_name

            from orchestra.vllm._scheduler import SchedulerSide

            dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
            self._scheduler = SchedulerSide(
                settings, dtype=dtype, model_path=str(vllm_config.model_config.model), block_size=block_size,
                hash_block_size=getattr(kv_cache_config, "hash_block_size", None) or block_size,
                hash_fn=get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo))
        else:
            from orchestra.vllm._worker import WorkerSide

            self._worker = WorkerSide(settings, block_size)

    # -- scheduler side ---------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.matched(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.allocated(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return FamilyMetadata(self._scheduler.step(scheduler_output))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        self._scheduler.finished(request)
        return False, None

    # -- worker side ------------------------------------------------------------------------------------------
    def _plan(self) -> StepPlan:
        meta = self._get_connector_metadata()
        return meta.plan if isinstance(meta, FamilyMetadata) else StepPlan()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        plan = self._plan()
        if plan.loads:
            self._worker.load(forward_context.no_compile_layers, plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads finish in start_load_kv, before the forward pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        assert self._worker is not None
        plan = self._plan()
        if plan.saves:
            from vllm.forward_context import get_forward_context

            layer = get_forward_context().no_compile_layers[layer_name]
            self._worker.save_layer(layer_name, layer, kv_layer, plan)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        if self.has_connector_metadata():
            self._worker.finish_saves(self._plan())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.failed_blocks() if self._worker is not None else set()

    def shutdown(self) -> None:
        for side in (self._scheduler, self._worker):
            if side is not None:
                side.close()
