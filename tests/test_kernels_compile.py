"""Both kernels compile for sm_90 (Hopper) with the installed triton, at the launch configurations
the operator picks (scripts/compile_check.py, in a subprocess: under TRITON_INTERPRET the kernels
are interpreted and cannot be compiled). Triton's compiler has crashed on tile shapes in one
release and not another; CI installs the oldest triton the test group declares (3.6.0), the
release the GPU tier ran on."""

import importlib.util
import pathlib

import torch
import torch._dynamo.testing

from msda.kernels import launch


def test_kernels_compile_for_hopper(compile_check):
    """(The check runs from the session's start where it can: tests/conftest.py.)"""
    process, output = compile_check
    returncode = process.wait()
    output.seek(0)
    text = output.read()
    assert returncode == 0, text[-8000:]
    assert "kernels compiled for sm_90" in text


def _compile_check(monkeypatch):
    """scripts/compile_check.py as a module."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # (the script refuses to load under it)
    path = pathlib.Path(__file__).parents[1] / "scripts" / "compile_check.py"
    spec = importlib.util.spec_from_file_location("compile_check", path)
    compile_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compile_check)
    return compile_check


def test_layout_check_reads_gathers_and_loops(monkeypatch):
    """compile_check's speed check of the lane placement (`lane_placement_layout_errors`) names a
    gather Triton could not lower to shuffles and a barrier inside a loop, and nothing in a loop
    of shuffles followed by a barrier after it (the epilogue's, which is once a program)."""
    errors = _compile_check(monkeypatch).lane_placement_layout_errors
    loop = "$L__BB0_1:  // =>This Inner Loop Header: Depth=1\n\tshfl.sync.idx.b32 %r1, %r2, %r3, 31, -1;\n"
    loop += "{}\t@%p1 bra $L__BB0_1;\n"
    fast = "%g = tt.gather %x[%i] {axis = 0 : i32, efficient_layout} : (tensor<8x2x2x1xi32, #blocked1>)"
    assert errors(fast, loop.format("") + "\tbar.sync 0;\n") == []
    assert errors(fast, loop.format("\tbar.sync 0;\n")) == ["1 barriers in the loop at $L__BB0_1"]
    slow = fast.replace(", efficient_layout", "")
    assert len(errors(slow, loop.format(""))) == 1 and "not warp-local" in errors(slow, "")[0]


def test_float64_placement_check_reads_fused_products(monkeypatch):
    """compile_check's `float64_placement_errors` names a float64 product fused with the -0.5 of
    the pixel centre (what triton 3.8 made of sampling.pixel_cell's `x * size + 0.0 - 0.5`) and
    a kernel that floors float64 coordinates without rounding a product first; the PTX of a
    placement that rounds its product passes, and so does float32's fma (its placement's own)."""
    errors = _compile_check(monkeypatch).float64_placement_errors
    floor = "\tcvt.rmi.f64.f64 %rd5, %rd4;\n"
    rounded = "\tmul.rn.f64 %rd3, %rd1, %rd2;\n\tadd.f64 %rd4, %rd3, 0dBFE0000000000000;\n" + floor
    fused = "\tfma.rn.f64 %rd4, %rd1, %rd2, 0dBFE0000000000000;\n" + floor
    float32 = "\tfma.rn.f32 %f3, %f1, %f2, 0fBF000000;\n\tcvt.rmi.f32.f32 %f4, %f3;\n"
    assert errors(rounded) == [] and errors(float32) == [] and errors("") == []
    assert len(errors(fused)) == 2 and "fused with -0.5" in errors(fused)[0]
    assert errors(rounded + fused) == [f"a product fused with -0.5: {fused.splitlines()[0].strip()}"]


def test_shared_tile_check_reads_the_kernels_shared_memory(monkeypatch):
    """compile_check's `shared_tile_allocation_errors` passes a shared tile kernel whose shared
    memory is its tile alone (ROWS rows of HEAD_DIM float32s, which its inline PTX addresses
    from `global_smem`) and names one with any more or less."""
    errors = _compile_check(monkeypatch).shared_tile_allocation_errors
    constexprs = {"ROWS": launch.SHARED_TILE_PIXELS + 36, "HEAD_DIM": 32}
    tile = (launch.SHARED_TILE_PIXELS + 36) * 32 * 4
    assert errors(tile, constexprs) == []
    named = f"the shared tile's kernel has {tile + 512} bytes of shared memory, its tile {tile}"
    assert errors(tile + 512, constexprs) == [named]
    assert len(errors(tile - 128, constexprs)) == 1


def test_a_whole_row_per_load_instruction():
    """The default tiles read each gathered value row with one 16-byte load per thread, a whole
    row per warp instruction (the L1 serves a row in one wavefront; bench/NOTES.md entry 13)."""
    for config in (launch.forward_config(4, 4, 32, torch.float32), launch.backward_config(4, 4, 32, torch.float32)):
        for element_size in (4, 2):
            c = config.constexprs(32, element_size, 4)
            threads_per_row = c["CHUNK"] // (16 // element_size)
            assert threads_per_row * 16 == 32 * element_size and c["BLOCK_D"] == c["CHUNK"]
            assert c["num_warps"] * 32 == c["BLOCK_Q"] * c["GROUPS"] * threads_per_row


def test_programs_fit_the_thread_limit():
    """No launch setting asks for more than 512 threads a program, whatever the row width
    (D = 256 in float64 is 128 loads of 16 bytes; the hardware limit is 1024)."""
    for config in (launch.forward_config(4, 4, 32, torch.float32), launch.backward_config(4, 4, 32, torch.float32)):
        for head_dim in (1, 3, 8, 24, 32, 48, 64, 96, 256):
            for element_size in (2, 4, 8):
                for points in (1, 2, 4, 8):
                    c = config.constexprs(head_dim, element_size, points)
                    threads = c["BLOCK_Q"] * c["GROUPS"] * max(1, c["CHUNK"] // max(1, 16 // element_size))
                    assert c["num_warps"] * 32 <= 512 and threads <= 512, (head_dim, element_size, points, c)


class _EncoderRule(torch.nn.Module):
    """1.0 where `launch.every_pixel_a_query` takes the call for an encoder's, else 0.0: the
    decision as a constant of the traced graph."""

    def forward(self, value, loc):
        encoder = launch.every_pixel_a_query(loc.shape[1], value.shape[1])
        return (value.sum() + loc.sum()) * 0 + (1.0 if encoder else 0.0)


def _rule_inputs(queries: int, pixels: int):
    return torch.ones(3, pixels, 2, 4), torch.ones(3, queries, 2, 2, 2, 2)


def test_encoder_rule_on_separate_symbols_adds_no_guard():
    """Where Q and S are two symbols (an export with separate dims; torch.compile's default
    after a call with Q != S), the encoder rule (`launch.every_pixel_a_query`) answers from the
    sizes the graph was traced at, with no guard: no recompile, no constraint on the dims (it
    used to answer False there, bench/NOTES.md entry 51). Every tile is exact at any shape."""
    queries, pixels = torch.export.Dim("Q", min=2), torch.export.Dim("S", min=2)
    for traced, expected in (((60, 60), 1.0), ((7, 9), 0.0)):
        dims = ({1: pixels}, {1: queries})
        exported = torch.export.export(_EncoderRule(), _rule_inputs(*traced), dynamic_shapes=dims)
        assert len(exported.range_constraints) == 2  # two symbols, neither tied to the other
        assert exported.module()(*_rule_inputs(11, 5)).item() == expected

    graphs = torch._dynamo.testing.EagerAndRecordGraphs()
    compiled = torch.compile(_EncoderRule(), backend=graphs, fullgraph=True)
    # Static, then one symbol (duck sizing), then two (Q != S broke the first's guard Q == S).
    for sizes, expected, compiles in (((6, 6), 1.0, 1), ((10, 10), 1.0, 2), ((7, 9), 0.0, 3), ((12, 14), 0.0, 3)):
        assert compiled(*_rule_inputs(*sizes)).item() == expected and len(graphs.graphs) == compiles

    env = torch.fx.experimental.symbolic_shapes.ShapeEnv()

    def symbol(hint):
        dynamic = torch.fx.experimental.symbolic_shapes.DimDynamic.DYNAMIC
        return env.create_unspecified_symint_and_symbol(hint, torch._dynamo.source.ConstantSource(f"s{hint}"), dynamic)

    q, s = symbol(22223), symbol(22222)
    assert launch.every_pixel_a_query(q, q) and not launch.every_pixel_a_query(q, s)
    assert launch.every_pixel_a_query(q, 22223) and not launch.every_pixel_a_query(300, s)
    assert not launch.every_pixel_a_query(env.create_unbacked_symint(), 22223)  # data-dependent: no hint
    assert not env.guards
