"""What the operator's per-call cost means in a real model: a transformers Deformable DETR, stock
against patched with csrc_free_ops.transformers.patch.

    python -m bench.detr [--batch 2] [--size 800 1333] [--steps 10] [--modes eager,compiled] [--smoke]
    python -m bench.detr --device cpu --no-compile --precisions float32 --kinds inference --out r.md

The model is DeformableDetrForObjectDetection built from its config: a ResNet-50 backbone
(transformers' own ResNet, random weights, nothing from the hub), 6 encoder and 6 decoder layers,
hidden size 256, 300 queries: 12 operator calls per forward. Stock runs transformers' pure-PyTorch
MultiScaleDeformableAttention (its hub kernel is not installed on such machines); patched runs
msda. Each of inference (no grad) and a training step (forward, a loss on the logits and boxes,
backward) is timed eager and under torch.compile, in float32 and under bfloat16 autocast, as the
median wall time of `--steps` steps after warm-up, with one synchronization per step. One table,
one process; `--modes`, `--precisions` and `--kinds` pick rows (a CPU run of every row at
800x1333 takes hours), `--out` also writes the table and the machine as markdown. `--smoke` builds
a tiny model on a 128 x 128 image (for CPU checks of this script).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

from .cpu import machine, markdown_table

RESNET50 = dict(embedding_size=64, hidden_sizes=[256, 512, 1024, 2048], depths=[3, 4, 6, 3], layer_type="bottleneck")
TINY = dict(embedding_size=8, hidden_sizes=[8, 16, 16, 32], depths=[1, 1, 1, 1], layer_type="basic")


def build(smoke: bool, seed: int = 0):
    """A DeformableDetrForObjectDetection from its config, random weights."""
    from transformers import DeformableDetrConfig, DeformableDetrForObjectDetection, ResNetConfig

    backbone = ResNetConfig(**(TINY if smoke else RESNET50), out_features=["stage2", "stage3", "stage4"])
    sizes = dict(d_model=32, encoder_layers=1, decoder_layers=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                 encoder_attention_heads=2, decoder_attention_heads=2, num_queries=10) if smoke else {}
    config = DeformableDetrConfig(
        backbone_config=backbone,
        use_timm_backbone=False,
        use_pretrained_backbone=False,
        disable_custom_kernels=True,  # stock: transformers' pure-PyTorch layer
        **sizes,
    )
    torch.manual_seed(seed)
    return DeformableDetrForObjectDetection(config)


def loss_of(outputs) -> torch.Tensor:
    """A training loss reaching every parameter without matching targets: logits and boxes."""
    return outputs.logits.float().square().mean() + outputs.pred_boxes.float().mean()


def median_step_ms(step, steps: int, device: torch.device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):  # warm-up: compiles, autotunes, grows the allocator
        step()
    sync()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--size", type=int, nargs=2, default=[800, 1333], metavar=("H", "W"))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES)}")
    parser.add_argument("--no-compile", action="store_true", help="eager rows only (--modes eager)")
    parser.add_argument("--precisions", default=",".join(PRECISIONS), help=f"of {', '.join(PRECISIONS)}")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"of {', '.join(KINDS)}")
    parser.add_argument("--out", type=Path, help="also write the table as markdown to this file")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on a 128 x 128 image")
    opts = parser.parse_args()
    precisions = _choices(parser, "--precisions", opts.precisions, PRECISIONS)
    kinds = _choices(parser, "--kinds", opts.kinds, KINDS)
    modes = ["eager"] if opts.no_compile else _choices(parser, "--modes", opts.modes, MODES)
    if opts.smoke:
        opts.size, opts.batch, opts.steps = [128, 128], 2, 2

    from rich.console import Console
    from rich.table import Table

    import csrc_free_ops.transformers

    device = torch.device(opts.device)
    pixels = torch.randn(opts.batch, 3, *opts.size, device=device)
    stock = build(opts.smoke).to(device)
    patched = build(opts.smoke).to(device)
    assert csrc_free_ops.transformers.patch(patched) > 0
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    title = (f"Deformable DETR, batch {opts.batch} at {opts.size[0]}x{opts.size[1]}, {name}, "
             f"torch {torch.__version__}: median ms per step")  # fmt: skip
    header = ["step", "mode", "precision", "stock", "patched (msda)", "speed-up"]
    table = Table(title=title)
    for column in header:
        table.add_column(column, justify="right" if column in ("stock", "patched (msda)", "speed-up") else "left")
    body = []
    machine_at_start = machine([torch.get_num_threads()])

    for mode in modes:
        for precision in precisions:
            autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if precision != "float32"
                        else contextlib.nullcontext())  # fmt: skip
            for kind in kinds:
                row = []
                for model in (stock, patched):
                    model.train(kind == "training")
                    run = torch.compile(model) if mode == "compiled" else model

                    def step(run=run, model=model, kind=kind, autocast=autocast):
                        with autocast:
                            if kind == "inference":
                                with torch.no_grad():
                                    run(pixel_values=pixels)
                            else:
                                model.zero_grad(set_to_none=True)
                                loss_of(run(pixel_values=pixels)).backward()

                    try:
                        row.append(median_step_ms(step, opts.steps, device))
                    except Exception as e:  # a failing row is a line, not a crash
                        row.append(None)
                        print(f"{kind} {mode} {precision} {'patched' if model is patched else 'stock'}: "
                              f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")  # fmt: skip
                cells = [f"{t:.1f}" if t is not None else "failed" for t in row]
                ratio = f"{row[0] / row[1]:.2f}x" if None not in row else "-"
                body.append([kind, mode, precision, *cells, ratio])
                table.add_row(*body[-1])
                if opts.out:
                    _write_markdown(opts.out, title, machine_at_start, header, body)
    Console().print(table)


MODES = ("eager", "compiled")
PRECISIONS = ("float32", "bfloat16 autocast")
KINDS = ("inference", "training")


def _choices(parser: argparse.ArgumentParser, option: str, text: str, allowed: tuple[str, ...]) -> list[str]:
    """A comma-separated subset of `allowed`, in the order given ("bfloat16" names "bfloat16 autocast")."""
    chosen = [next((a for a in allowed if a.split()[0] == x.strip()), x.strip()) for x in text.split(",") if x.strip()]
    unknown = [x for x in chosen if x not in allowed]
    if unknown or not chosen:
        parser.error(f"{option}: {', '.join(unknown) or 'nothing'} is not one of {', '.join(allowed)}")
    return chosen


def _write_markdown(path: Path, title: str, info: dict[str, str], header: list[str], body: list[list[str]]) -> None:
    """The rows so far, under the machine's description as at the start (rewritten after every row)."""
    lines = [f"# {title}", ""] + [f"- {k}: {v}" for k, v in info.items()]
    lines += [f"- command: python -m bench.detr {' '.join(sys.argv[1:])}", "", markdown_table(header, body), ""]
    path.write_text("\n".join(lines))


if __name__ == "__main__":
    main()
