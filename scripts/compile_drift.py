"""Diagnose: how far a compiled training step of the tiny transformers Deformable DETR drifts from
eager on this device, stock (grid_sample) and patched onto msda. Prints relative errors of the
outputs and the flat gradients, and the parameters that drift most."""

import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from csrc_free_ops import transformers as hf_patch  # noqa: E402
from msda.testing import relative_error  # noqa: E402
from msda.testing_cases import OUTPUTS, flat, pixel_values, tiny_deformable_detr, training_loss  # noqa: E402


def run(model, pixels, compiled):
    model.zero_grad(set_to_none=True)
    fn = torch.compile(training_loss, fullgraph=True) if compiled else training_loss
    loss, outputs = fn(model, pixels)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return {k: v.detach().float() for k, v in outputs.items()}, grads


def compare(label, a, b):
    (oa, ga), (ob, gb) = a, b
    outs = {k: f"{relative_error(oa[k], ob[k]):.1e}" for k in OUTPUTS}
    per = sorted((((ga[n] - gb[n]).norm().item(), n) for n in ga), reverse=True)[:4]  # largest absolute drift
    print(f"{label}: outputs {outs} grads {relative_error(flat(ga), flat(gb)):.2e}")
    for err, name in per:
        print(f"    |diff| {err:.2e} {name} |g|={gb[name].norm():.2e}")


def main():
    device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    for tf32 in (True, False):
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = tf32
        print(f"== {device} tf32={tf32}")
        stock = tiny_deformable_detr().to(device).eval()
        patched = copy.deepcopy(stock)
        hf_patch.patch(patched)
        pixels = pixel_values().to(device)
        torch._dynamo.reset()
        se, sc = run(stock, pixels, False), run(stock, pixels, True)
        torch._dynamo.reset()
        pe, pc = run(patched, pixels, False), run(patched, pixels, True)
        compare("stock compiled vs stock eager", sc, se)
        compare("patched compiled vs patched eager", pc, pe)
        compare("patched eager vs stock eager", pe, se)
        compare("patched eager run twice", run(patched, pixels, False), pe)


if __name__ == "__main__":
    main()
