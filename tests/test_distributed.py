"""A training step under PyTorch's own distributed engines equals one process on the whole
batch (issue 15, item 7), on CPU with the gloo backend: two processes launched by torchrun,
tests/deformable_detr.py at its tiny size (the full structure: deformable encoder, decoder with
deformable cross-attention), DistributedDataParallel eager and torch.compile'd, and FSDP2
(fully_shard) eager. Loss, every gradient and every parameter after an SGD step within
the float32 bound of docs/contract.md of the single process. tests/gpu/test_gpu_distributed.py runs NCCL on
two GPUs at Deformable DETR's size, DDP and FSDP2, eager and compiled.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .deformable_detr import SIZES, make_model

ROOT = Path(__file__).resolve().parents[1]


def parameter_count(size: str) -> int:
    return len(list(make_model(SIZES[size]).parameters()))


def torchrun(tmp_path: Path, *worker_args: str, timeout: int = 600) -> dict:
    """Run tests/distributed_worker.py in two processes; its rank-0 summary."""
    out = tmp_path / "summary.json"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        "-m", "tests.distributed_worker", *worker_args, "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    output = f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    assert result.returncode == 0, f"torchrun exited {result.returncode}:\n{output}"
    summary = json.loads(out.read_text())
    assert summary["ok"] and summary["world"] == 2, summary
    return summary


@pytest.mark.parametrize("mode", ["eager", pytest.param("compiled", marks=pytest.mark.compile)])
def test_ddp_gloo_step_equals_one_process(tmp_path, mode):
    summary = torchrun(tmp_path, "--backend", "gloo", "--strategy", "ddp", "--mode", mode)
    assert summary["max_error"] <= 1e-5 and summary["parameters"] == parameter_count("tiny")
    if mode == "compiled":
        assert summary["compiled_graphs"] >= 1


def test_fsdp2_gloo_step_equals_one_process(tmp_path):
    """FSDP2 (fully_shard per layer and at the root) shards parameters and gradients as DTensors;
    the full tensors equal the single process's."""
    summary = torchrun(tmp_path, "--backend", "gloo", "--strategy", "fsdp2", "--mode", "eager")
    assert summary["max_error"] <= 1e-5 and summary["parameters"] == parameter_count("tiny")
