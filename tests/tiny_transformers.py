"""A tiny randomly initialised transformers Deformable DETR (no download), for the CPU and GPU tiers."""

from __future__ import annotations

import torch


def tiny_deformable_detr(seed: int = 0):
    """DeformableDetrModel with d_model 32 on a 4-stage ResNet of 8 to 32 channels: 4 levels
    (8x8, 4x4, 2x2, 1x1 for a 64x64 image), one encoder and one decoder layer, no dropout."""
    from transformers import DeformableDetrConfig, DeformableDetrModel, ResNetConfig

    backbone = ResNetConfig(
        embedding_size=8,
        hidden_sizes=[8, 16, 16, 32],
        depths=[1, 1, 1, 1],
        layer_type="basic",
        out_features=["stage2", "stage3", "stage4"],
    )
    config = DeformableDetrConfig(
        backbone_config=backbone,
        use_timm_backbone=False,  # older transformers default to a timm backbone
        use_pretrained_backbone=False,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        num_queries=10,
        num_feature_levels=4,
        encoder_n_points=2,
        decoder_n_points=2,
        dropout=0.0,
        disable_custom_kernels=True,  # the stock side is transformers' pure-PyTorch layer
    )
    torch.manual_seed(seed)
    model = DeformableDetrModel(config)
    # The grid init offsets whole pixels, so encoder samples land exactly on pixel centres: kinks
    # of bilinear interpolation, where the two paths' float rounding picks different one-sided
    # gradients. A trained model's offsets are off the lattice; so are these.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sampling_offsets.bias"):
                p.add_(torch.empty_like(p).uniform_(-0.4, 0.4))
    return model


def pixel_values(batch: int = 2, size: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(seed))


OUTPUTS = ("last_hidden_state", "encoder_last_hidden_state")


def training_loss(model, pixels: torch.Tensor):
    """(loss, outputs): a fixed, uneven weighting of both outputs, which reaches every parameter.

    Both outputs leave a LayerNorm, whose sum and sum of squares are constant: such a loss has
    no gradient but rounding.
    """
    out = model(pixel_values=pixels)
    outputs = {key: out[key] for key in OUTPUTS}
    loss = sum((t.float() * _fixed_weights(t)).mean() for t in outputs.values())
    return loss, outputs


def _fixed_weights(t: torch.Tensor) -> torch.Tensor:
    """Deterministic weights in [-1, 1] of t's shape, made on its device (no generator to trace)."""
    return torch.arange(t.numel(), device=t.device).reshape(t.shape).float().mul(0.618).sin()


def outputs_and_grads(model, pixels: torch.Tensor):
    """(outputs, {parameter name: gradient}) of one eager training step."""
    loss, outputs = training_loss(model, pixels)
    loss.backward()
    return outputs, {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def flat(grads: dict) -> torch.Tensor:
    """All gradients as one float32 vector. Some are zero but for rounding (biases before a
    GroupNorm, the 1x1 level's norm): compared alone their relative error means nothing."""
    return torch.cat([grads[name].flatten().float() for name in sorted(grads)])
