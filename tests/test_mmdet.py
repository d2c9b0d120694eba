"""mmdet end to end (issue 15, item 6): the recipe of docs/correctness.md, on CPU with
mmcv-lite (no compiled ops). mmdet's own Deformable DETR config (ResNet-50, 6 + 6 layers,
300 queries) built with random weights by `init_detector`, inference through
`inference_detector`, and one training step, each running msda in all 12 attention layers:

- float32: the recipe as a user runs it, outputs and gradients finite;
- float64: the training step's loss gradients for every parameter equal those of the same model
  with mmcv's own pure-PyTorch MSDA and with the float64 oracle, within 1e-10. (In float32 the
  model's gradients are ill-conditioned: two exact MSDAs differ by 1e-3 there, so float32
  comparisons would compare rounding.)

Needs mmdet 3.3.0, mmengine 0.10.7 and mmcv-lite 2.1.0 (mmdet 3.3 refuses mmcv 2.2); skipped
with that reason where they are not installed.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

PINS = "pip install mmdet==3.3.0 mmengine==0.10.7 mmcv-lite==2.1.0"
for _name in ("mmcv", "mmengine", "mmdet"):
    pytest.importorskip(_name, reason=f"{_name} is not installed (the mmdet end-to-end test needs: {PINS})")

import mmcv  # noqa: E402
from mmengine.utils import digit_version  # noqa: E402

if digit_version(mmcv.__version__) >= digit_version("2.2.0"):
    pytest.skip(f"mmdet 3.3 refuses mmcv {mmcv.__version__} (it needs < 2.2.0): {PINS}", allow_module_level=True)

import csrc_free_ops.mmcv  # noqa: E402
from msda.testing import reference, relative_error  # noqa: E402

# mmcv's own grid_sample implementation, kept before patch() replaces it (mmcv-lite needs the
# stand-in mmcv._ext to import its ops at all).
MMCV_MODULE = csrc_free_ops.mmcv._import_target()
MMCV_PYTORCH = MMCV_MODULE.multi_scale_deformable_attn_pytorch
csrc_free_ops.mmcv.patch()
MSDA = MMCV_MODULE.multi_scale_deformable_attn_pytorch

import mmdet  # noqa: E402
from mmdet.apis import inference_detector, init_detector  # noqa: E402
from mmdet.structures import DetDataSample  # noqa: E402
from mmengine.config import Config  # noqa: E402
from mmengine.structures import InstanceData  # noqa: E402

CONFIG = os.path.join(os.path.dirname(mmdet.__file__), ".mim", "configs", "deformable_detr")
CONFIG = os.path.join(CONFIG, "deformable-detr_r50_16xb2-50e_coco.py")
H, W = 96, 128  # a small image keeps the CPU run short: 16x12, 8x6, 4x3 and 2x2 feature levels
ATTENTION_LAYERS = 12


def oracle(value, value_spatial_shapes, sampling_locations, attention_weights):
    shapes = torch.as_tensor(value_spatial_shapes, device=value.device)
    return reference(value, shapes, sampling_locations, attention_weights).to(value.dtype)


@pytest.fixture(scope="module")
def pristine_detector():
    """init_detector on the config, random weights (no checkpoint), the test pipeline resizing
    to the small image; then, for comparable training steps, no dropout and attention offsets
    and weights moved off their initialization (whose offsets sit on the pixel lattice, where
    the location gradient is one-sided)."""
    cfg = Config.fromfile(CONFIG)
    for step in cfg.test_dataloader.dataset.pipeline:
        if step["type"] == "Resize":
            step["scale"] = (W, H)
    torch.manual_seed(0)
    model = init_detector(cfg, checkpoint=None, device="cpu")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        # Without a checkpoint init_detector runs no init_weights(), and DeformableDETR allocates
        # level_embed with torch.Tensor(...): uninitialized memory, whose garbage (up to 1.7e38
        # under MALLOC_PERTURB_=1) made every output NaN now and then, depending on what the
        # process had freed before. init_weights() itself would fetch the pretrained backbone;
        # this is its line for level_embed.
        model.level_embed.normal_(generator=gen)
        for name, p in model.named_parameters():
            if "sampling_offsets" in name or "attention_weights" in name:
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(module, torch.nn.MultiheadAttention):
            module.dropout = 0.0
    return model


@pytest.fixture
def detector(pristine_detector):
    """A fresh copy for each test, so that no test sees the state another left (a training step
    changes more than the parameters)."""
    return copy.deepcopy(pristine_detector)


@pytest.fixture
def counted(monkeypatch):
    """The patched MSDA, counting its calls."""
    calls = []

    def msda(*args):
        calls.append(args[0].dtype)
        return MSDA(*args)

    monkeypatch.setattr(MMCV_MODULE, "multi_scale_deformable_attn_pytorch", msda)
    return calls


def image(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (3, H, W), generator=gen, dtype=torch.uint8)


def training_batch(model, dtype=torch.float32):
    sample = DetDataSample(metainfo=dict(img_shape=(H, W), ori_shape=(H, W), scale_factor=(1.0, 1.0)))
    boxes = torch.tensor([[10.0, 12.0, 60.0, 70.0], [40.0, 20.0, 120.0, 90.0]], dtype=dtype)
    sample.gt_instances = InstanceData(bboxes=boxes, labels=torch.tensor([3, 17]))
    data = model.data_preprocessor(dict(inputs=[image()], data_samples=[sample]), training=True)
    data["inputs"] = data["inputs"].to(dtype)
    return data


def training_step_gradients(model, dtype=torch.float32) -> dict[str, torch.Tensor]:
    model.train()
    model.zero_grad(set_to_none=True)
    losses = model(**training_batch(model, dtype), mode="loss")
    loss = sum(value for name, value in losses.items() if "loss" in name)
    assert torch.isfinite(loss)
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_stand_in_extension_has_a_spec_without_a_loader():
    """mmengine's mmcv_full_available() inside init_detector: find the module, no loader."""
    import importlib.util
    import pkgutil

    from mmengine.utils.dl_utils import mmcv_full_available

    assert importlib.util.find_spec("mmcv._ext") is not None
    assert pkgutil.find_loader("mmcv._ext") is None
    assert mmcv_full_available() is False


def test_inference_runs_msda_in_every_attention_layer(detector, counted):
    detector.eval()
    result = inference_detector(detector, image(1).permute(1, 2, 0).numpy())
    assert counted == [torch.float32] * ATTENTION_LAYERS
    boxes, scores = result.pred_instances.bboxes, result.pred_instances.scores
    assert boxes.shape == (100, 4) and scores.shape == (100,)
    assert torch.isfinite(boxes).all() and torch.isfinite(scores).all()


def test_training_step(detector, counted):
    before = {name: p.detach().clone() for name, p in detector.named_parameters()}
    grads = training_step_gradients(detector)
    assert counted == [torch.float32] * ATTENTION_LAYERS
    assert all(torch.isfinite(g).all() for g in grads.values())
    attention = [n for n in grads if "sampling_offsets" in n or ".attention_weights." in n]
    assert len(attention) == 4 * ATTENTION_LAYERS and all(grads[n].abs().sum() > 0 for n in attention)
    optimizer = torch.optim.SGD(detector.parameters(), lr=1e-4)
    optimizer.step()
    moved = [n for n, p in detector.named_parameters() if not torch.equal(p, before[n])]
    assert set(attention) <= set(moved)


def test_float64_training_step_equals_mmcvs_and_the_oracle(detector, monkeypatch):
    detector.double()
    with_msda = training_step_gradients(detector, torch.float64)
    monkeypatch.setattr(MMCV_MODULE, "multi_scale_deformable_attn_pytorch", MMCV_PYTORCH)
    with_mmcv = training_step_gradients(detector, torch.float64)
    monkeypatch.setattr(MMCV_MODULE, "multi_scale_deformable_attn_pytorch", oracle)
    with_oracle = training_step_gradients(detector, torch.float64)
    assert with_msda.keys() == with_mmcv.keys() == with_oracle.keys()
    for name, grad in with_msda.items():
        assert relative_error(grad, with_oracle[name]) <= 1e-10, name
        assert relative_error(grad, with_mmcv[name]) <= 1e-10, name
