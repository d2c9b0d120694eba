"""Compiled or not, the same call gets the same error (docs/contract.md, "Bad input"): on CPU the checks
that read the level data (S = sum(H_l * W_l), empty or negative levels, level_start_index the
running sum) run when a compiled graph runs, with the message of the eager call. On CPU the
compiled graph keeps msda's operators whole (msda/ops.py, `_keep_whole_on_cpu`), so it is their
bodies that check the data, at run time (the last test here checks that they stay whole); the
`msda::check_levels` node that a traced body leaves in the graph is the CUDA path's, under
msda.validate() (tests/gpu/test_gpu_validate.py), and opcheck tests that operator here.

The battery is test_bad_input.py's data-dependent cases. It runs under the "aot_eager" backend
(the graph AOTAutograd traces, run by PyTorch) for every case; Inductor itself runs the issue's
examples and the backward.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.functional_tensor import FunctionalTensorMode

import msda
from msda import ops, validation

from .test_bad_input import BAD_CALLS, FORWARD_ARGS, call, valid_args

pytestmark = pytest.mark.compile

DATA_CASES = [case for case in BAD_CALLS if case.needs_data]


def eager_error(entry: str, args: dict) -> str:
    with pytest.raises(ValueError) as info:
        call(entry, args)
    return str(info.value)


def compiled_call(entry: str, backend: str):
    """`call(entry, ...)` compiled with fullgraph=True (no graph break can hide the check)."""

    def fn(*tensors):
        return call(entry, dict(zip((*FORWARD_ARGS, "grad_output"), tensors)))

    return torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)


def test_battery_has_data_cases():
    assert len(DATA_CASES) >= 10, [case.id for case in DATA_CASES]


@pytest.mark.parametrize("entry", ["functional", "forward", "backward"])
@pytest.mark.parametrize("case", DATA_CASES, ids=lambda case: case.id)
def test_compiled_call_raises_the_eager_error(case, entry):
    args = case.edit(valid_args())
    expected = eager_error(entry, args)
    torch._dynamo.reset()
    compiled = compiled_call(entry, "aot_eager")
    with pytest.raises(ValueError) as info:
        compiled(*(args[name] for name in (*FORWARD_ARGS, "grad_output")))
    assert str(info.value) == expected


# The two calls of the issue (S = 16 against 13 rows of levels, and a level_start_index of
# [0, 3]), a negative level, and a level_start_index past the end, through Inductor.
ISSUE_VALUE = (1, 16, 2, 4)
ISSUE_CASES = {
    "S-is-not-the-level-sizes": ([[3, 4], [1, 1]], None),
    "wrong-level-start-index": ([[3, 4], [2, 2]], [0, 3]),
    "negative-level": ([[-3, -4], [2, 2]], [0, 12]),
    "level-start-index-past-the-end": ([[3, 4], [2, 2]], [0, 100]),
}


def _issue_call(levels, starts, seed=0):
    gen = torch.Generator().manual_seed(seed)
    value = torch.randn(ISSUE_VALUE, generator=gen)
    loc = torch.rand(1, 3, 2, 2, 2, 2, generator=gen)
    attn = torch.rand(1, 3, 2, 2, 2, generator=gen)
    starts = None if starts is None else torch.tensor(starts)
    return value, torch.tensor(levels), starts, loc, attn


def test_inductor_checks_at_run_time_with_the_eager_message():
    """One compiled function (dynamic shapes, so no call recompiles for its new data) gets the
    eager error for each bad call, and the right answer for a good one, in any order."""
    torch._dynamo.reset()
    compiled = torch.compile(msda.multi_scale_deformable_attention, fullgraph=True, dynamic=True)
    good = _issue_call([[3, 4], [2, 2]], [0, 12])
    torch.testing.assert_close(compiled(*good), msda.multi_scale_deformable_attention(*good))
    for name, (levels, starts) in ISSUE_CASES.items():
        if starts is None:  # the functional form computes the start index: a separate graph
            continue
        args = _issue_call(levels, starts)
        with pytest.raises(ValueError) as eager:
            msda.multi_scale_deformable_attention(*args)
        with pytest.raises(ValueError) as compiled_error:
            compiled(*args)
        assert str(compiled_error.value) == str(eager.value), name
    torch.testing.assert_close(compiled(*good), msda.multi_scale_deformable_attention(*good))


def test_inductor_checks_with_a_computed_level_start_index():
    levels, _ = ISSUE_CASES["S-is-not-the-level-sizes"]
    args = _issue_call(levels, None)
    expected = eager_error("functional", dict(zip(FORWARD_ARGS, args)))
    assert "S = 16" in expected and "13" in expected
    torch._dynamo.reset()
    compiled = torch.compile(msda.multi_scale_deformable_attention, fullgraph=True)
    with pytest.raises(ValueError) as info:
        compiled(*args)
    assert str(info.value) == expected


def test_inductor_compiled_backward_checks_too():
    """torch.ops.msda.backward compiled on its own (as a compiled backward graph calls it)."""
    good = valid_args()
    bad = {**good, "level_start_index": torch.tensor([0, 11])}
    expected = eager_error("backward", bad)
    torch._dynamo.reset()
    compiled = torch.compile(torch.ops.msda.backward, fullgraph=True)
    order = ("grad_output", *FORWARD_ARGS)
    for got, want in zip(compiled(*(good[n] for n in order)), call("backward", good)):
        torch.testing.assert_close(got, want)
    with pytest.raises(ValueError) as info:
        compiled(*(bad[n] for n in order))
    assert str(info.value) == expected


def test_operator_stays_whole_in_the_compiled_graph_on_cpu():
    """On CPU the compiled graph keeps the operators whole (msda/ops.py, _keep_whole_on_cpu):
    their bodies run when the graph runs, on real tensors, and check the data there (the tests
    above see the error). Were the bodies traced instead, the check would have to be a node of
    the graph: msda::check_levels (what the functional form adds on CUDA under msda.validate())."""
    graphs = []

    def backend(gm, example_inputs):
        from torch._dynamo.backends.common import aot_autograd

        def record(graph, _):
            graphs.append(graph)
            return graph.forward

        return aot_autograd(fw_compiler=record, bw_compiler=record)(gm, example_inputs)

    args = valid_args()
    value, loc, attn = (args[n].clone().requires_grad_() for n in ("value", "sampling_locations", "attention_weights"))
    torch._dynamo.reset()
    compiled = torch.compile(msda.multi_scale_deformable_attention, backend=backend, fullgraph=True)
    compiled(value, args["spatial_shapes"], args["level_start_index"], loc, attn).sum().backward()
    assert len(graphs) == 2
    check = torch.ops.msda.check_levels.default
    for graph, op, custom_op in zip(
        graphs, (torch.ops.msda.forward.default, torch.ops.msda.backward.default), (ops.forward, ops.backward)
    ):
        targets = [node.target for node in graph.graph.nodes if node.op == "call_function"]
        # A torch whose triton_op has no FunctionalTensorMode rule leaves _keep_whole_on_cpu
        # nothing to replace: there the body is traced, and must bring its check along.
        if FunctionalTensorMode in getattr(custom_op, "_torch_dispatch_fns", {}):
            assert op in targets and check not in targets, graph.code
        else:
            assert check in targets, graph.code


def test_validate_is_a_context_manager_and_a_decorator():
    before = validation.enabled()
    with msda.validate():
        assert validation.enabled()
        with msda.validate(False):
            assert not validation.enabled()
        assert validation.enabled()
    assert validation.enabled() == before

    @msda.validate()
    def inside():
        return validation.enabled()

    assert inside() and validation.enabled() == before


@pytest.mark.parametrize("setting,expected", [("1", True), ("0", False), ("", False), ("true", True), ("off", False)])
def test_msda_validate_environment_variable(monkeypatch, setting, expected):
    monkeypatch.setenv("MSDA_VALIDATE", setting)
    assert validation._validate_from_environment() is expected


def test_msda_validate_rejects_other_values(monkeypatch):
    monkeypatch.setenv("MSDA_VALIDATE", "yes please")
    with pytest.raises(ValueError, match="MSDA_VALIDATE must be 1"):
        validation._validate_from_environment()


def test_opcheck_of_the_check_operator():
    args = valid_args()
    torch.library.opcheck(
        torch.ops.msda.check_levels.default, (16, args["spatial_shapes"], args["level_start_index"])
    )
    with pytest.raises(ValueError, match="expected sum"):
        torch.ops.msda.check_levels(17, args["spatial_shapes"], args["level_start_index"])
