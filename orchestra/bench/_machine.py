"""The machine a benchmark ran on: recorded with every result, since CPU timings mean nothing without it."""

from __future__ import annotations

import os
import platform
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["MachineInfo", "machine_info"]


class MachineInfo(BaseModel):
    """CPU, cores, library versions and the torch device the benchmark used."""

    model_config = ConfigDict(extra="forbid")
    cpu_model: str = Field(description="CPU model name (from /proc/cpuinfo where available)")
    cpu_count: int = Field(description="logical CPUs visible to the process")
    torch_threads: int = Field(description="threads torch uses for intra-op parallelism")
    device: str = Field(description="torch device of the models (and its name for CUDA)")
    python: str
    torch: str
    transformers: str
    platform: str


def _cpu_model() -> str:
    # platform.processor() is empty on most Linux builds; /proc/cpuinfo has the marketing name.
    info = Path("/proc/cpuinfo")
    if info.is_file():
        for line in info.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown"


def machine_info(device: str = "cpu") -> MachineInfo:
    """Describe this machine; ``device`` is the torch device the models run on."""
    import torch
    import transformers

    name = device
    if device.startswith("cuda") and torch.cuda.is_available():
        name = f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    return MachineInfo(
        cpu_model=_cpu_model(), cpu_count=os.cpu_count() or 0, torch_threads=torch.get_num_threads(), device=name,
        python=platform.python_version(), torch=torch.__version__, transformers=transformers.__version__,
        platform=platform.platform(),
    )
