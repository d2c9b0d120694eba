"""GPU tier: torch.export of a Deformable-DETR-style block on CUDA keeps the operator as one
node with dynamic batch, query count and image size; torch.export.save / load round-trips and
matches eager; torch._inductor.aoti_compile_and_package builds a package that carries the
Triton kernels themselves (not a call back into Python)."""

import zipfile

import pytest
import torch
import torch._inductor

from ..detr_block import check_export_round_trip, export_block, make_block

pytestmark = pytest.mark.compile


@pytest.mark.parametrize("fused_softmax", [True, False], ids=["fused-softmax", "unfused"])
def test_block_exports_with_dynamic_batch_queries_and_image_size(tmp_path, fused_softmax):
    check_export_round_trip("cuda", tmp_path / "block.pt2", fused_softmax)


def test_block_compiles_with_aotinductor(tmp_path):
    exported = export_block(make_block("cuda").eval())
    package = torch._inductor.aoti_compile_and_package(exported, package_path=str(tmp_path / "block_aoti.pt2"))
    # The package is only built, never loaded here: loading an AOTInductor package
    # (torch._inductor.aoti_load_package) segfaulted on the GPU machine the tier was run on
    # (torch 2.11.0+cu130, NVIDIA driver 580) even for a model without custom operators (seen
    # 2026-11-29), which would take the whole test session down. What is checked instead: inductor
    # lowered the triton_op to its Triton kernel (named msda_forward_kernel_<n> in the generated
    # code), so the package runs without Python.
    with zipfile.ZipFile(package) as archive:
        members = [name for name in archive.namelist() if b"msda_forward_kernel" in archive.read(name)]
    assert members, f"no file of {package} names msda_forward_kernel"
