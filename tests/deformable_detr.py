"""A Deformable DETR transformer on msda.MultiScaleDeformableAttention, for training-step tests
(distributed, under load): an encoder of deformable self-attention over the flattened feature
levels (each token a query at its own pixel centre), a decoder of self-attention, deformable
cross-attention and FFN over learned queries with reference points, and class and box heads.
No backbone: the inputs are the feature levels. Dropout is left out, so that a training step
is a deterministic function of the parameters and the batch.

`SIZES["detr"]` is Deformable DETR's (hidden size 256, 8 heads, 4 levels, 4 points, 6 + 6
layers, FFN 1024, 300 queries); `SIZES["tiny"]` keeps the structure at CPU-test size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

import msda


@dataclass(frozen=True)
class Size:
    d_model: int
    heads: int
    levels: int
    points: int
    encoder_layers: int
    decoder_layers: int
    d_ffn: int
    queries: int
    classes: int
    image: tuple[int, int]  # (H, W) in pixels; level l has stride 8 * 2**l


SIZES = {
    "detr": Size(256, 8, 4, 4, 6, 6, 1024, 300, 91, (512, 672)),
    "tiny": Size(32, 2, 2, 2, 1, 2, 64, 7, 5, (48, 40)),
}


def level_shapes(size: Size) -> list[tuple[int, int]]:
    h, w = size.image
    return [(math.ceil(h / (8 * 2**level)), math.ceil(w / (8 * 2**level))) for level in range(size.levels)]


class EncoderLayer(nn.Module):
    def __init__(self, s: Size):
        super().__init__()
        self.attn = msda.MultiScaleDeformableAttention(s.d_model, s.levels, s.heads, s.points)
        self.norm1 = nn.LayerNorm(s.d_model)
        self.ffn = nn.Sequential(nn.Linear(s.d_model, s.d_ffn), nn.ReLU(), nn.Linear(s.d_ffn, s.d_model))
        self.norm2 = nn.LayerNorm(s.d_model)

    def forward(self, x, pos, reference_points, shapes, starts):
        x = self.norm1(x + self.attn(x + pos, reference_points, x, shapes, starts))
        return self.norm2(x + self.ffn(x))


class DecoderLayer(nn.Module):
    def __init__(self, s: Size):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(s.d_model, s.heads, batch_first=True)
        self.norm1 = nn.LayerNorm(s.d_model)
        self.cross_attn = msda.MultiScaleDeformableAttention(s.d_model, s.levels, s.heads, s.points)
        self.norm2 = nn.LayerNorm(s.d_model)
        self.ffn = nn.Sequential(nn.Linear(s.d_model, s.d_ffn), nn.ReLU(), nn.Linear(s.d_ffn, s.d_model))
        self.norm3 = nn.LayerNorm(s.d_model)

    def forward(self, q, query_pos, reference_points, memory, shapes, starts):
        k = q + query_pos
        q = self.norm1(q + self.self_attn(k, k, q, need_weights=False)[0])
        q = self.norm2(q + self.cross_attn(q + query_pos, reference_points, memory, shapes, starts))
        return self.norm3(q + self.ffn(q))


class DeformableTransformer(nn.Module):
    """features (B, S, d_model) flattened levels -> (class logits (B, Q, classes), boxes (B, Q, 4))."""

    def __init__(self, size: Size):
        super().__init__()
        self.size = size
        s = size
        self.level_embed = nn.Parameter(torch.randn(s.levels, s.d_model) * 0.02)
        self.encoder = nn.ModuleList(EncoderLayer(s) for _ in range(s.encoder_layers))
        self.query_embed = nn.Embedding(s.queries, 2 * s.d_model)
        self.reference_points = nn.Linear(s.d_model, 2)
        self.decoder = nn.ModuleList(DecoderLayer(s) for _ in range(s.decoder_layers))
        self.class_head = nn.Linear(s.d_model, s.classes)
        self.box_head = nn.Sequential(nn.Linear(s.d_model, s.d_model), nn.ReLU(), nn.Linear(s.d_model, 4))

    def positions(self, shapes: list[tuple[int, int]], device) -> tuple[Tensor, Tensor]:
        """Sine position embeddings plus level embeddings (S, d_model), and each token's
        normalized pixel centre (S, 2)."""
        half = self.size.d_model // 2
        pos, centres = [], []
        for level, (h, w) in enumerate(shapes):
            ys, xs = torch.meshgrid(
                (torch.arange(h, device=device) + 0.5) / h, (torch.arange(w, device=device) + 0.5) / w, indexing="ij"
            )
            xy = torch.stack((xs.flatten(), ys.flatten()), -1)
            freq = 10000 ** (torch.arange(half // 2, device=device) / (half // 2))
            angles = (xy[:, :, None] * 2 * math.pi / freq).flatten(1)  # (S_l, half)
            pos.append(torch.cat((angles.sin(), angles.cos()), -1) + self.level_embed[level])
            centres.append(xy)
        return torch.cat(pos), torch.cat(centres)

    def forward(self, features: Tensor, spatial_shapes: Tensor, level_start_index: Tensor):
        B = features.shape[0]
        L = self.size.levels
        pos, centres = self.positions(level_shapes(self.size), features.device)
        reference = centres[None, :, None, :].expand(B, -1, L, 2)
        x = features
        for layer in self.encoder:
            x = layer(x, pos, reference, spatial_shapes, level_start_index)
        query_pos, q = self.query_embed.weight.chunk(2, dim=-1)
        query_pos, q = query_pos.expand(B, -1, -1), q.expand(B, -1, -1)
        points = self.reference_points(query_pos).sigmoid()[:, :, None, :].expand(B, -1, L, 2)
        for layer in self.decoder:
            q = layer(q, query_pos, points, x, spatial_shapes, level_start_index)
        return self.class_head(q), self.box_head(q).sigmoid()


def make_model(size: Size, seed: int = 0, device="cpu") -> DeformableTransformer:
    """The model with every parameter moved off its initialization (so sampling offsets are off
    the pixel lattice, where location gradients are one-sided, and attention is not uniform)."""
    torch.manual_seed(seed)
    model = DeformableTransformer(size)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
    return model.to(device)


def make_batch(size: Size, batch: int, seed: int = 0, device="cpu"):
    """(features, spatial_shapes, level_start_index, class targets, box targets)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = torch.tensor(level_shapes(size))
    tokens = int(shapes.prod(1).sum())
    features = torch.randn(batch, tokens, size.d_model, generator=gen)
    classes = torch.randint(0, size.classes, (batch, size.queries), generator=gen)
    boxes = torch.rand(batch, size.queries, 4, generator=gen)
    batch_tensors = (features, shapes, msda.level_start_index_from_shapes(shapes), classes, boxes)
    return tuple(t.to(device) for t in batch_tensors)


def loss_fn(model, features, spatial_shapes, level_start_index, classes, boxes) -> Tensor:
    """Cross-entropy on the classes plus L1 on the boxes, averaged over the batch (so that the
    mean of per-rank losses over equal shards is the loss of the whole batch)."""
    logits, predicted = model(features, spatial_shapes, level_start_index)
    ce = nn.functional.cross_entropy(logits.flatten(0, 1), classes.flatten())
    return ce + (predicted - boxes).abs().mean()
