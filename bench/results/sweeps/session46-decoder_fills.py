"""Session 46: the half-precision decoders' backward, kernel by kernel, in four turns of one
process: the replicas in a fill of their own and folded by the fold kernel (entry 97), the
replicas sharing grad_value's fill (`backward.ONE_FILL_REPLICA_SHARE`), that and the fold in the
backward kernel (`backward.folds_in_kernel`, the default), and no replicas at all (entry 96's
unsound rule: what the buffer and the fold cost together). Then the eager backward's end-to-end
time (`eager.launch_backward` called directly, and forward + backward through autograd) with the
prepared launches of this session against the argument builder (HEAD's path for a call with
replicas).

    PYTHONPATH=. python3 bench/results/sweeps/session46-decoder_fills.py
"""

from __future__ import annotations

import statistics

import torch

import msda
from bench.phases import kernel_times
from bench.timing import end_to_end_time, graph_device_time
from msda import eager
from msda.kernels import backward, launch
from msda.testing import DETR_LEVELS, PRESETS, Shape, make_inputs, reference_with_grads, relative_error

RT_DETR_LEVELS = ((80, 80), (40, 40), (20, 20))
SHAPES = {  # (shape, dist)
    "decoder preset": (PRESETS["decoder"], "uniform"),
    "RT-DETR decoder, B=4": (Shape(4, 300, 8, 32, RT_DETR_LEVELS, 4), "local"),
    "DINO 4-scale (Q=900)": (Shape(4, 900, 8, 32, DETR_LEVELS, 4), "local"),
}
ROWS, SHARE, KEEP = backward.replica_rows, backward.ONE_FILL_REPLICA_SHARE, eager._keep_prepared
IN_KERNEL = backward.FOLD_IN_KERNEL_ELEMENTS


def keep_forwards_only(launches, *args) -> None:  # HEAD's eager path for a backward with replicas
    if launches is eager._forward_launches:
        KEEP(launches, *args)


def use(variant: str) -> None:
    rows = (lambda *args, **kwargs: None) if variant == "no replicas" else ROWS
    backward.replica_rows = launch.replica_rows = rows
    backward.ONE_FILL_REPLICA_SHARE = 2**62 if variant == "own fill" else SHARE
    backward.FOLD_IN_KERNEL_ELEMENTS = IN_KERNEL if variant == "folded here" else 0


def short(name: str) -> str:
    return name.split("(")[0][:40]


def main() -> None:
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    variants = ("own fill", "one fill", "folded here", "no replicas")
    for name, (shape, dist) in SHAPES.items():
        for dtype in (torch.float16, torch.bfloat16):
            inputs = make_inputs(shape, dtype, "cuda", dist=dist, seed=1)
            args = inputs.args()
            grad = torch.randn(shape.batch, shape.queries, shape.heads * shape.head_dim, device="cuda", dtype=dtype)
            call = lambda: torch.ops.msda.backward(grad, *args)  # noqa: E731
            totals = {v: [] for v in variants}
            graphs = {v: [] for v in variants}
            kernels = {v: {} for v in variants}
            for _ in range(3):
                for v in variants:
                    use(v)
                    times = kernel_times(call, 20)
                    totals[v].append(sum(us for _, us in times))
                    for kernel, us in times:
                        kernels[v].setdefault(short(kernel), []).append(us)
                    graphs[v].append(graph_device_time(call, 20, 5).median_us)
            _, expected, _, _ = reference_with_grads(inputs, grad)
            print(f"{name} {str(dtype)[6:]} ({dist})", flush=True)
            for v in variants:
                use(v)
                error = relative_error(call()[0].double(), expected)
                parts = ", ".join(f"{k} {statistics.median(us):.1f}" for k, us in kernels[v].items())
                print(f"  {v:11} profiler {statistics.median(totals[v]):6.1f} graph {statistics.median(graphs[v]):6.1f}"
                      f" err {error:.2e}  [{parts}]", flush=True)  # fmt: skip
            del expected
            use("folded here")
            # End to end: the eager backward alone, then a step through autograd.
            leaves = [t.detach().clone().requires_grad_(True) for t in (args[0], args[3], args[4])]

            def step():
                out = msda.multi_scale_deformable_attention(leaves[0], args[1], args[2], leaves[1], leaves[2])
                torch.autograd.grad(out, leaves, grad)

            for prepared in (True, False):
                eager._keep_prepared = KEEP if prepared else keep_forwards_only
                eager._backward_launches.clear()
                eager._fold_launches.clear()
                alone = end_to_end_time(lambda: eager.launch_backward(grad, *args), 100, 5)
                through = end_to_end_time(step, 100, 5)
                print(f"  eager, {'prepared' if prepared else 'builder '}: launch_backward {alone} "
                      f"step {through}", flush=True)  # fmt: skip
            eager._keep_prepared = KEEP


if __name__ == "__main__":
    main()
