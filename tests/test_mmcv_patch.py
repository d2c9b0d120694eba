"""csrc_free_ops.mmcv: mmcv's Function and fallback on msda, and patch() routing mmcv's module.

mmcv is not a test dependency: patch() is tested on a minimal stand-in package with mmcv's
layout (`mmcv.utils.ext_loader.load_ext`, `mmcv.ops.multi_scale_deform_attn`), with the
compiled `mmcv._ext`, without it (mmcv-lite), and with one that does not load.
"""

import importlib
import importlib.machinery
import sys
import textwrap

from unittest import mock

import pytest
import torch

from csrc_free_ops import mmcv as mmcv_patch
from msda import eager_cpu, ops, torch_impl
from msda.testing import Shape, make_inputs, reference

from .helpers import assert_matches_reference, forward_backward, operator_bodies, random_like_output

SHAPE = Shape(batch=3, queries=9, heads=2, head_dim=4, levels=((6, 7), (3, 4)), points=2)

FAKE_MMCV = {
    "mmcv/__init__.py": "",
    "mmcv/utils/__init__.py": "from . import ext_loader",
    "mmcv/utils/ext_loader.py": """
        import importlib

        def load_ext(name, funcs):
            ext = importlib.import_module("mmcv." + name)
            for fun in funcs:
                assert hasattr(ext, fun), f"{fun} miss in module {name}"
            return ext
    """,
    "mmcv/ops/__init__.py": """
        from .nms import nms
        from .multi_scale_deform_attn import MultiScaleDeformableAttention, MultiScaleDeformableAttnFunction
    """,
    "mmcv/ops/nms.py": """
        from ..utils import ext_loader
        ext_module = ext_loader.load_ext("_ext", ["nms"])

        def nms(boxes):
            return ext_module.nms(boxes)
    """,
    # mmcv's structure: the compiled Function on CUDA, a grid_sample fallback elsewhere.
    "mmcv/ops/multi_scale_deform_attn.py": """
        import torch
        from ..utils import ext_loader
        ext_module = ext_loader.load_ext("_ext", ["ms_deform_attn_backward", "ms_deform_attn_forward"])

        class MultiScaleDeformableAttnFunction(torch.autograd.Function):
            @staticmethod
            def forward(ctx, value, shapes, starts, loc, attn, im2col_step):
                return ext_module.ms_deform_attn_forward(value, shapes, starts, loc, attn, im2col_step=im2col_step)

        def multi_scale_deformable_attn_pytorch(value, shapes, loc, attn):
            raise AssertionError("mmcv's own CPU path ran")

        class MultiScaleDeformableAttention(torch.nn.Module):
            im2col_step = 64

            def forward(self, value, shapes, starts, loc, attn):
                if value.is_cuda:
                    return MultiScaleDeformableAttnFunction.apply(value, shapes, starts, loc, attn, self.im2col_step)
                return multi_scale_deformable_attn_pytorch(value, shapes, loc, attn)
    """,
}

COMPILED_EXT = """
    def _compiled(*args, **kwargs):
        raise AssertionError("mmcv's compiled op ran")

    nms = ms_deform_attn_forward = ms_deform_attn_backward = _compiled
"""


# mmcv._ext as each kind of install has it: loading, absent, or a library that fails to load.
EXT_FILES = {
    "compiled": {"mmcv/_ext.py": COMPILED_EXT},
    "mmcv-lite": {},
    "broken": {f"mmcv/_ext{importlib.machinery.EXTENSION_SUFFIXES[0]}": "not a shared library"},
}


@pytest.fixture
def fake_mmcv(tmp_path, monkeypatch):
    """Write the stand-in mmcv with one of EXT_FILES and put it first on sys.path; every mmcv
    module imported meanwhile is dropped afterwards."""
    for name in [n for n in sys.modules if n == "mmcv" or n.startswith("mmcv.")]:
        monkeypatch.delitem(sys.modules, name)

    def write(ext: str):
        for path, source in {**FAKE_MMCV, **EXT_FILES[ext]}.items():
            (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / path).write_text(textwrap.dedent(source))
        monkeypatch.syspath_prepend(str(tmp_path))

    yield write
    for name in [n for n in sys.modules if n == "mmcv" or n.startswith("mmcv.")]:
        del sys.modules[name]


def _expected(inputs):
    return reference(inputs.value, inputs.spatial_shapes, inputs.sampling_locations, inputs.attention_weights).float()


def test_function_apply_matches_reference_for_any_im2col_step():
    inputs = make_inputs(SHAPE, outside_fraction=0.1)
    grad_output = random_like_output(inputs)

    def apply(value, shapes, starts, loc, attn):
        return mmcv_patch.MultiScaleDeformableAttnFunction.apply(value, shapes, starts, loc, attn, 2)

    assert_matches_reference(inputs, forward_backward(inputs, grad_output, apply), grad_output)


def test_function_apply_and_ext_module_take_the_cpu_fast_path(monkeypatch):
    """On eager CPU tensors mmcv's Function and ext_module's backward skip the registered
    operator (msda/eager_cpu.py)."""
    monkeypatch.setattr(ops, "BACKEND", "torch")  # the CPU path, under any MSDA_BACKEND
    inputs = make_inputs(SHAPE, outside_fraction=0.1, seed=8)
    grad_output = random_like_output(inputs)
    grads = [torch.zeros_like(t) for t in (inputs.value, inputs.sampling_locations, inputs.attention_weights)]

    def apply(value, shapes, starts, loc, attn):
        return mmcv_patch.MultiScaleDeformableAttnFunction.apply(value, shapes, starts, loc, attn, 2)

    with (
        mock.patch.object(eager_cpu, "forward", wraps=eager_cpu.forward) as fast_forward,
        mock.patch.object(eager_cpu, "backward", wraps=eager_cpu.backward) as fast_backward,
        mock.patch.object(torch_impl, "_cpu_backward", wraps=torch_impl._cpu_backward) as cpu_backward,
        operator_bodies() as entered,
    ):
        forward_backward(inputs, grad_output, apply)
        assert (fast_forward.call_count, cpu_backward.call_count, entered()) == (1, 1, 0)
        with torch.no_grad():  # as in mmcv's once-differentiable backward
            mmcv_patch.ext_module.ms_deform_attn_backward(*inputs.args(), grad_output, *grads, im2col_step=2)
        assert fast_backward.call_count == 1 and entered() == 0


def test_pytorch_fallback_matches_reference_with_tensor_or_list_shapes():
    inputs = make_inputs(SHAPE)
    for shapes in (inputs.spatial_shapes, inputs.spatial_shapes.tolist()):
        actual = mmcv_patch.multi_scale_deformable_attn_pytorch(
            inputs.value, shapes, inputs.sampling_locations, inputs.attention_weights
        )
        torch.testing.assert_close(actual, _expected(inputs), rtol=1e-5, atol=1e-5)


def test_ext_module_backward_writes_in_place_like_mmcvs():
    inputs = make_inputs(SHAPE)
    grad_output = random_like_output(inputs)
    grads = [torch.zeros_like(t) for t in (inputs.value, inputs.sampling_locations, inputs.attention_weights)]
    mmcv_patch.ext_module.ms_deform_attn_backward(*inputs.args(), grad_output, *grads, im2col_step=2)
    expected = torch.ops.msda.backward(grad_output, *inputs.args())
    for actual, want in zip(grads, expected):
        assert torch.equal(actual, want)


def test_patch_without_mmcv_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mmcv", None)  # import mmcv raises ImportError
    with pytest.raises(ImportError, match="pip install mmcv-lite"):
        mmcv_patch.patch()


def test_patch_routes_mmcvs_module_and_function_to_msda(fake_mmcv):
    fake_mmcv("compiled")
    import mmcv.ops

    held_before_patch = mmcv.ops.MultiScaleDeformableAttnFunction
    assert mmcv_patch.patch() is sys.modules["mmcv.ops.multi_scale_deform_attn"]
    assert mmcv.ops.MultiScaleDeformableAttnFunction is mmcv_patch.MultiScaleDeformableAttnFunction

    inputs = make_inputs(SHAPE)
    # The module's non-CUDA branch, and mmcv's own Function through the replaced ext_module.
    module_out = mmcv.ops.MultiScaleDeformableAttention()(*inputs.args())
    function_out = held_before_patch.apply(*inputs.args(), 64)
    for out in (module_out, function_out):
        torch.testing.assert_close(out, _expected(inputs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ext", ["mmcv-lite", "broken"])
def test_patch_makes_mmcv_ops_importable_without_compiled_ops(fake_mmcv, ext):
    fake_mmcv(ext)
    with pytest.raises(ImportError):
        importlib.import_module("mmcv.ops")  # what such an install does unpatched
    mmcv_patch.patch()
    import mmcv.ops

    inputs = make_inputs(SHAPE)
    module_out = mmcv.ops.MultiScaleDeformableAttention()(*inputs.args())
    torch.testing.assert_close(module_out, _expected(inputs), rtol=1e-5, atol=1e-5)
    with pytest.raises(NotImplementedError, match="'nms' needs mmcv's compiled ops"):
        mmcv.ops.nms(torch.zeros(1, 4))


@pytest.mark.parametrize("ext", ["mmcv-lite", "broken"])
def test_stand_in_extension_answers_mmengines_probe(fake_mmcv, ext):
    """mmengine's mmcv_full_available() (called by mmdet's init_detector) probes
    pkgutil.find_loader("mmcv._ext"): the stand-in must answer it (a module without __spec__
    makes it raise ValueError) and say no loader, as no compiled mmcv is there."""
    import importlib.util
    import pkgutil

    fake_mmcv(ext)
    mmcv_patch.patch()
    spec = importlib.util.find_spec("mmcv._ext")
    assert spec is not None and spec.name == "mmcv._ext"
    assert pkgutil.find_loader("mmcv._ext") is None
