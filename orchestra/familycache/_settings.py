"""Where a pipeline's or server's model work runs: the ``executor:`` settings `make_executor` builds from.

The settings belong to the executors (this package), not to the pipeline that names them: pipelines, the
server and the Ray executor read them from here, and `orchestra.pipelines.spec` re-exports them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["ExecutorSpec", "MemberResources", "VllmOptions"]


class MemberResources(BaseModel):
    """What one member's Ray actors reserve and how many there are (the ray executor only)."""

    model_config = ConfigDict(extra="forbid")
    num_cpus: float | None = Field(None, gt=0, description="Logical CPUs each actor reserves (default: the executor's).")
    num_gpus: float | None = Field(None, ge=0, description="GPUs each actor reserves (default: the executor's); "
                                   "an actor with a GPU puts its model on it.")
    replicas: int = Field(1, ge=1, le=64, description="Actors for this member; ops and agents go to the least busy.")
    threads: int | None = Field(None, ge=1, description="torch threads in each actor (default: the executor's).")


class VllmOptions(BaseModel):
    """How the vllm executor starts its engines (one vLLM server per member, each with the family connector)."""

    model_config = ConfigDict(extra="forbid")
    args: list[str] = Field(default_factory=list, description="More arguments for every engine's server "
                            "(`--max-model-len 4096`, `--gpu-memory-utilization 0.4`, ...).")
    dtype: str = Field("auto", description="The engines' dtype: auto is float32 on a CPU and bfloat16 on a GPU.")
    store: str | None = Field(None, description="The KV store the engines share (default: <home>/kv).")
    start_timeout_s: float = Field(900.0, gt=0, description="Seconds each engine may take to answer /health.")


class ExecutorSpec(BaseModel):
    """Where model work runs: ``local`` (this process, the default), ``ray`` (one Ray actor per member and
    replica) or ``vllm`` (one vLLM engine per member, the document's cache loaded through the family connector).

    In YAML: ``executor: ray`` or ``executor: {kind: ray, address: auto, members: {tuned: {num_gpus: 1,
    replicas: 2}}}``, ``executor: {kind: vllm, vllm: {args: [--max-model-len, "4096"]}}``. The driver keeps
    the DAG, gates, events and report every way; see docs/scale-out.md and docs/vllm.md.
    """

    model_config = ConfigDict(extra="forbid")
    kind: Literal["local", "ray", "vllm"] = Field(
        "local", description="local: in-process threads; ray: Ray actors; vllm: one vLLM engine per member.")
    vllm: VllmOptions = Field(default_factory=VllmOptions, description="vllm: how the engines start.")
    address: str | None = Field(
        None, description="ray: 'local' or unset: a private Ray started for this process (unless RAY_ADDRESS is set); "
        "'auto': the cluster `ray start` runs on this machine; 'ray://host:port' (Ray Client) or 'host:port'.",
    )
    placement: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="Strategy of the pipeline's placement group (one bundle per actor).")
    num_cpus: float = Field(1.0, gt=0, description="Logical CPUs each actor reserves unless `members` says otherwise.")
    num_gpus: float = Field(0.0, ge=0, description="GPUs each actor reserves unless `members` says otherwise.")
    threads: int | None = Field(None, ge=1, description="torch threads per actor (default: the node's cores, "
                                "as a local run uses).")
    members: dict[str, MemberResources] = Field(default_factory=dict, description="Per model alias: resources, replicas.")
    max_restarts: int = Field(3, ge=-1, description="Restarts of a dead actor (its in-flight work fails; -1: always).")
    ready_timeout_s: float = Field(300.0, gt=0, description="Seconds to wait for the placement group and model loads.")

    @model_validator(mode="before")
    @classmethod
    def _from_kind(cls, data: object) -> object:
        return {"kind": data} if isinstance(data, str) else data

    def resources(self, alias: str) -> MemberResources:
        """The member's resources with the executor's defaults filled in."""
        own = self.members.get(alias, MemberResources())
        return MemberResources(num_cpus=own.num_cpus or self.num_cpus,
                               num_gpus=own.num_gpus if own.num_gpus is not None else self.num_gpus,
                               replicas=own.replicas, threads=own.threads or self.threads)
