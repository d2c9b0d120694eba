"""What the bench ran on: the device, its clocks, the CPU and the versions of everything timed."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

import torch

import msda


def machine_info(device: torch.device, threads: int) -> dict:
    """The `machine` entry of results.json. `threads`: the CPU timer's thread count."""
    info = {
        "device": str(device),
        "gpu": None,
        "clocks": None,
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "threads": threads,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": version("triton"),
        "msda": msda.__version__,
        "msda_backend": msda.ops.BACKEND,
        "peers": {"deformops": version("deformops"), "mmcv": version("mmcv") or version("mmcv-lite")},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = torch.cuda.get_device_name(device)
        info["gpu_memory_GiB"] = round(props.total_memory / 2**30, 1)
        info["multiprocessors"] = props.multi_processor_count
        info["clocks"] = gpu_clocks()
    return info


def gpu_clocks() -> dict | None:
    """Clocks and limits from nvidia-smi (MHz, W), or None without it."""
    fields = "name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem,power.draw,power.limit"
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return None
    return dict(zip(fields.split(","), (v.strip() for v in out.split(","))))


def version(distribution: str) -> str | None:
    """The installed version of `distribution`, or None."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
