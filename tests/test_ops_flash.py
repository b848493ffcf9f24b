"""FLASH mixed-chunk attention: every mode against the float64 naive loop (outputs, state, gradients),
continuation from any split point, the step as a traced graph, and argument checks."""

from functools import cache

import pytest
import torch

from edgeattn.ops.flash import FlashState, mixed_chunk_attention, mixed_chunk_step
from tests.helpers import assert_close, grads

MODES = ["recurrent", "chunk", "parallel"]
S, E = 16, 24


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The per-token loops (naive, recurrent) are thousands of tiny ops: on a busy machine a second
    intra-op thread makes them an order of magnitude slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_inputs(B, T, C, positions=None, dtype=torch.float32, seed=0):
    """Leaves: q_quad, k_quad, q_lin, k_lin, v, rel_bias and (with ``positions``, one per row) a random
    mid-chunk state whose buffers are zero from the position on, as every form returns them. Its
    chunk_state is random in every row, position 0 included: every form must add it to the chunk
    the state ends in."""
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(B, T, S, generator=gen) for _ in range(4)] + [torch.randn(B, T, E, generator=gen)]
    rel_bias = torch.randn(C, generator=gen)
    init = None
    if positions is not None:
        pos = torch.tensor(positions, dtype=torch.float32)
        filled = (torch.arange(C) < pos[:, None]).float().unsqueeze(-1)  # [B, C, 1]
        init = FlashState(
            torch.randn(B, S, E, generator=gen),
            torch.randn(B, S, E, generator=gen),
            torch.randn(B, C, S, generator=gen) * filled,
            torch.randn(B, C, E, generator=gen) * filled,
            pos,
        )
    leaf = lambda x: x.to(dtype).requires_grad_()  # noqa: E731
    init = None if init is None else FlashState(*(leaf(x) for x in init[:4]), init.position)
    return [leaf(x) for x in xs], leaf(rel_bias), init


def run(xs, rel_bias, init, mode, C, dtype=None):
    """Outputs (o and every final-state tensor) and the gradients of every differentiable leaf."""
    conv = (lambda x: x) if dtype is None else (lambda x: x.to(dtype))
    state0 = None if init is None else FlashState(*(conv(x) for x in init))
    o, final = mixed_chunk_attention(
        *(conv(x) for x in xs),
        chunk_size=C,
        rel_bias=conv(rel_bias),
        initial_state=state0,
        output_final_state=True,
        mode=mode,
    )
    outs = [o, *final]
    leaves = [*xs, rel_bias, *([] if init is None else init[:4])]  # position is not differentiable
    return outs, grads(outs, leaves)


@cache
def naive_reference(T, C, positions, dtype):
    """The float64 naive outputs and gradients, computed once for all the modes compared with them."""
    xs, rel_bias, init = make_inputs(2, T, C, positions, dtype)
    outs, gs = run(xs, rel_bias, init, "naive", C, dtype=torch.float64)
    return [x.detach() for x in outs], gs


def check_against_naive(T, C, positions, mode, dtype=torch.float32):
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    positions = None if positions is None else tuple(positions)
    xs, rel_bias, init = make_inputs(2, T, C, positions, dtype)
    ref_outs, ref_grads = naive_reference(T, C, positions, dtype)
    outs, gs = run(xs, rel_bias, init, mode, C)
    names = ["o", *FlashState._fields]
    for name, a, b in zip(names, outs, ref_outs):
        assert_close(f"{mode} {name}", a, b, tol)
    assert torch.equal(outs[-1].double(), ref_outs[-1]), "position"
    leaf_names = ["q_quad", "k_quad", "q_lin", "k_lin", "v", "rel_bias", *FlashState._fields[:4]]
    for name, a, b in zip(leaf_names, gs, ref_grads):
        assert_close(f"{mode} grad {name}", a, b, tol)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "T, C", [(1, 16), (63, 16), (64, 16), (65, 16), (63, 64), (64, 64), (65, 64), (500, 64)]
)
@pytest.mark.parametrize("start", ["empty", "mid_chunk"])
def test_modes_match_naive_float32(mode, T, C, start):
    # Rows at different positions: one at a chunk boundary, one mid-chunk.
    positions = None if start == "empty" else [0, C // 2 + 3]
    check_against_naive(T, C, positions, mode)


@pytest.mark.parametrize("mode", MODES)
def test_long_sequence_small_chunks_match_naive(mode):
    check_against_naive(500, 16, [15, 1], mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("start", ["empty", "mid_chunk"])
def test_modes_match_naive_bfloat16(mode, start):
    check_against_naive(65, 16, None if start == "empty" else [5, 12], mode, dtype=torch.bfloat16)
    xs, rel_bias, init = make_inputs(1, 9, 16, [3], torch.bfloat16)
    o, final = mixed_chunk_attention(
        *xs, chunk_size=16, rel_bias=rel_bias, initial_state=init, output_final_state=True, mode=mode
    )
    assert o.dtype == torch.bfloat16
    assert all(x.dtype == torch.float32 for x in final)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("split", [1, 5, 16, 37, 64, 99])
def test_split_and_continue_equals_whole(mode, split):
    C, T = 16, 130
    xs, rel_bias, init = make_inputs(2, T, C, [0, 9])
    kw = dict(chunk_size=C, rel_bias=rel_bias, output_final_state=True, mode=mode)
    o_full, s_full = mixed_chunk_attention(*xs, initial_state=init, **kw)
    o1, s1 = mixed_chunk_attention(*(x[:, :split] for x in xs), initial_state=init, **kw)
    o2, s2 = mixed_chunk_attention(*(x[:, split:] for x in xs), initial_state=s1, **kw)
    assert_close("output", torch.cat([o1, o2], 1), o_full, 1e-5)
    for name, a, b in zip(FlashState._fields, s2, s_full):
        assert_close(name, a, b, 1e-5)


@pytest.mark.parametrize(
    "first, rest", [("chunk", "recurrent"), ("recurrent", "chunk"), ("parallel", "chunk")]
)
def test_state_passes_between_modes(first, rest):
    """Prefill in one form, continue in another (chunk prefill, then token-by-token steps)."""
    C = 16
    xs, rel_bias, _ = make_inputs(2, 75, C)
    kw = dict(chunk_size=C, rel_bias=rel_bias, output_final_state=True)
    ref, s_ref = mixed_chunk_attention(
        *(x.double() for x in xs), **{**kw, "rel_bias": rel_bias.double()}, mode="naive"
    )
    o, state, outs = None, None, []
    for lo, hi, mode in [(0, 21, first), (21, 40, rest), (40, 41, first), (41, 75, rest)]:
        o, state = mixed_chunk_attention(*(x[:, lo:hi] for x in xs), initial_state=state, mode=mode, **kw)
        outs.append(o)
    assert_close("output", torch.cat(outs, 1), ref, 1e-5)
    for name, a, b in zip(FlashState._fields, state, s_ref):
        assert_close(name, a, b, 1e-5)


def test_defaults_are_one_over_chunk_size_and_zero_bias():
    C = 16
    xs, _, init = make_inputs(1, 40, C, [7])
    o, _ = mixed_chunk_attention(*xs, chunk_size=C, initial_state=init)
    explicit = dict(quad_scale=1 / C, lin_scale=1 / C, rel_bias=torch.zeros(C))
    ref, _ = mixed_chunk_attention(*xs, chunk_size=C, initial_state=init, mode="naive", **explicit)
    assert_close("defaults", o, ref, 1e-5)
    o2, st = mixed_chunk_attention(*xs, chunk_size=C, initial_state=init, quad_scale=0.5, lin_scale=2.0)
    assert st is None
    ref2, _ = mixed_chunk_attention(
        *xs, chunk_size=C, initial_state=init, quad_scale=0.5, lin_scale=2.0, mode="naive"
    )
    assert_close("scales", o2, ref2, 1e-5)
    assert (o2 - o).abs().max() > 1e-2  # the scales are used


def test_traced_step_works_at_every_position():
    """The step traced once (as the ONNX exporter does) equals the eager step at every position,
    including the one that folds the chunk: no branch on a tensor value was baked into the trace."""
    C, B = 8, 2
    xs, rel_bias, init = make_inputs(B, 1, C, [0, 0])
    tokens = [x[:, 0].detach() for x in xs]
    rel_bias = rel_bias.detach()
    state0 = FlashState(*(x.detach() for x in init))

    def step(qq, kq, ql, kl, v, *state):
        o, new = mixed_chunk_step(qq, kq, ql, kl, v, state, quad_scale=0.3, lin_scale=0.2, rel_bias=rel_bias)
        return (o, *new)

    with torch.no_grad():
        traced = torch.jit.trace(step, (*tokens, *state0), check_trace=False)
        for positions in ([0, 3], [C - 1, 5], [C - 2, C - 1]):
            _, _, state = make_inputs(B, 1, C, positions, seed=sum(positions))
            state = [x.detach() for x in state]
            for a, b in zip(traced(*tokens, *state), step(*tokens, *state)):
                assert_close(f"traced step at {positions}", a, b, 1e-6)


def test_step_cost_has_no_chunk_sized_fold():
    """The step's matmuls cost O(C (S + E) + S E) per token: the chunk is folded from its running sum
    (an S x E outer product per token), never re-summed from buffered keys (C S E)."""
    from torch.utils.flop_counter import FlopCounterMode

    B, C, S_, E_ = 1, 64, 128, 512
    x = [torch.randn(B, S_) for _ in range(4)] + [torch.randn(B, E_)]
    zero = [torch.zeros(B, S_, E_), torch.zeros(B, S_, E_), torch.zeros(B, C, S_), torch.zeros(B, C, E_)]
    for p in (0.0, C - 1.0):  # an ordinary token and the one that folds the chunk
        state = FlashState(*zero, torch.tensor([p]))
        with FlopCounterMode(display=False) as counter:
            mixed_chunk_step(*x, state, quad_scale=0.1, lin_scale=0.1, rel_bias=torch.zeros(C))
        assert counter.get_total_flops() <= 2 * B * (C * (S_ + E_) + S_ * E_ + C * C)


def test_traced_chunk_form_works_at_every_position():
    """The chunk form traced with a state at position 0 (as the prefill graph is) takes any position."""
    C, B, T = 8, 2, 12
    xs, rel_bias, init = make_inputs(B, T, C, [0, 0])
    xs, rel_bias = [x.detach() for x in xs], rel_bias.detach()

    def prefill(qq, kq, ql, kl, v, *state):
        o, new = mixed_chunk_attention(
            qq, kq, ql, kl, v, chunk_size=C, rel_bias=rel_bias, initial_state=state, output_final_state=True
        )
        return (o, *new)

    with torch.no_grad():
        traced = torch.jit.trace(prefill, (*xs, *(x.detach() for x in init)), check_trace=False)
        for positions in ([3, 7], [C - 1, 1]):
            _, _, state = make_inputs(B, T, C, positions, seed=1)
            state = [x.detach() for x in state]
            ref = mixed_chunk_attention(
                *xs,
                chunk_size=C,
                rel_bias=rel_bias,
                initial_state=state,
                output_final_state=True,
                mode="naive",
            )
            for a, b in zip(traced(*xs, *state), (ref[0], *ref[1])):
                assert_close(f"traced chunk form at {positions}", a, b, 1e-5)


def _bad_state(C):
    _, _, init = make_inputs(2, 4, C, [1, 2])
    return init


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: {"q_quad": a["q_quad"][0]}, r"q_quad must have shape \[B, T, S\]"),
        (lambda a: {"k_quad": a["k_quad"][..., :3]}, r"k_quad must have shape \[B, T, S\] \(as q_quad\)"),
        (lambda a: {"q_lin": a["q_lin"][:, :2]}, r"q_lin must have shape \[B, T, S\]"),
        (lambda a: {"k_lin": a["k_lin"][:1]}, r"k_lin must have shape \[B, T, S\]"),
        (lambda a: {"v": a["v"][:, :3]}, r"v must have shape \[B, T, E\]"),
        (lambda a: {"chunk_size": 0}, r"chunk_size must be a positive int"),
        (lambda a: {"chunk_size": 4.0}, r"chunk_size must be a positive int"),
        (lambda a: {"rel_bias": torch.zeros(9)}, r"rel_bias must have shape \[chunk_size\] = \(8,\)"),
        (lambda a: {"initial_state": _bad_state(8)[:4]}, r"initial_state must be a tuple \(linear_state"),
        (
            lambda a: {"initial_state": _bad_state(8)._replace(key_quad=torch.zeros(2, 16, S))},
            r"initial_state\[2\] \(key_quad\) must have shape \[B, chunk_size, S\]",
        ),
        (
            lambda a: {"initial_state": _bad_state(8)._replace(chunk_state=torch.zeros(2, 8, S))},
            r"initial_state\[1\] \(chunk_state\) must have shape \[B, S, E\]",
        ),
        (
            lambda a: {"initial_state": _bad_state(8)._replace(value=torch.zeros(2, 8, S))},
            r"initial_state\[3\] \(value\) must have shape \[B, chunk_size, E\]",
        ),
        (
            lambda a: {"initial_state": _bad_state(8)._replace(linear_state=torch.zeros(2, E, S))},
            r"initial_state\[0\] \(linear_state\) must have shape \[B, S, E\]",
        ),
        (
            lambda a: {"initial_state": _bad_state(8)._replace(position=torch.zeros(2, 1))},
            r"initial_state\[4\] \(position\) must have shape \[B\]",
        ),
        (
            lambda a: {"initial_state": _bad_state(8)._replace(position=torch.tensor([8.0, 0.0]))},
            r"position\) must hold integers in \[0, chunk_size=8\)",
        ),
        (lambda a: {"mode": "fast"}, r"mode must be one of"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(change, match):
    xs, _, _ = make_inputs(2, 4, 8)
    args = dict(zip(["q_quad", "k_quad", "q_lin", "k_lin", "v"], xs), chunk_size=8)
    args.update(change(args))
    with pytest.raises(ValueError, match=match):
        mixed_chunk_attention(**args)
