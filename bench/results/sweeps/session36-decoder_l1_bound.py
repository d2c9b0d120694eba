# Run from the repository root: PYTHONPATH=. python bench/results/sweeps/session36-decoder_l1_bound.py
"""Upper bound on L1 reuse at the float32 decoder forward: distinct corner rows per program
(16 queries of one (b, m)) against distinct rows per group of G consecutive programs of one head
(as if an SM held them together), with perfect caching inside the group."""
import torch
from bench.variants import PRESETS
from msda.testing import make_inputs

for dist in ("uniform", "local"):
    shape = PRESETS["decoder"]
    inp = make_inputs(shape, torch.float32, dist=dist, seed=0)
    loc = inp.sampling_locations  # B, Q, M, L, K, 2
    B, Q, M, L, K, _ = loc.shape
    shapes = inp.spatial_shapes.tolist()
    starts = inp.level_start_index.tolist()
    ids = torch.empty(B, Q, M, L, K, 4, dtype=torch.int64)
    for level, (h, w) in enumerate(shapes):
        x = loc[:, :, :, level, :, 0] * w - 0.5
        y = loc[:, :, :, level, :, 1] * h - 0.5
        x0, y0 = x.floor().long(), y.floor().long()
        for c, (dx, dy) in enumerate(((0, 0), (1, 0), (0, 1), (1, 1))):
            xx, yy = x0 + dx, y0 + dy
            ok = (xx >= 0) & (xx < w) & (yy >= 0) & (yy < h)
            ids[:, :, :, level, :, c] = torch.where(ok, starts[level] + yy * w + xx, -1)
    total_fetch = (ids >= 0).sum().item()
    for G in (1, 2, 4, 5, 19):
        distinct = 0
        for b in range(B):
            for m in range(M):
                per_q = ids[b, :, m].reshape(Q, -1)
                blocks = [per_q[i:i + 16] for i in range(0, Q, 16)]
                for j in range(0, len(blocks), G):
                    group = torch.cat(blocks[j:j + G]).flatten()
                    group = group[group >= 0]
                    distinct += group.unique().numel()
        print(f"{dist:8s} G={G:2d}: corner fetches {total_fetch}, distinct per group {distinct} "
              f"({distinct / total_fetch:.3f} of fetches), MB {distinct * 128 / 1e6:.1f}")
