"""Properties of the linear attention backward references: the causal dot product's three forms and the layer."""

import inspect

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import assert_close, block_sizes, linear_cases, seeds, seqlens

from reference import (
    causal_dot_product,
    causal_dot_product_backward,
    causal_dot_product_backward_chunked,
    causal_dot_product_backward_recurrent,
    causal_dot_product_chunked,
    linear_attention,
    linear_attention_backward,
)

# Central differences with step h: truncation ~ h^2 |f'''| (the causal dot product is trilinear, so its
# f''' is a single product), rounding ~ 1e-16 |f| / h. The tolerance FD_RTOL * sum_i |grad_i d_i| +
# FD_ATOL * (a bound on |f|'s terms) is about 100 times the rounding term (errors measured over 1500 random
# examples stay below 2% of it); a wrong sign or a missing term is off by a fraction of the gradient itself.
FD_STEP = 1e-6
FD_RTOL = 1e-6
FD_ATOL = 1e-8

CDP_BACKWARDS = {
    "definition": causal_dot_product_backward,
    "recurrent": causal_dot_product_backward_recurrent,
    "chunked": lambda *args, **kwargs: causal_dot_product_backward_chunked(*args, chunk_size=3, **kwargs),
}


def _central_difference(loss, inputs, directions):
    plus = loss(*(x + FD_STEP * d for x, d in zip(inputs, directions)))
    minus = loss(*(x - FD_STEP * d for x, d in zip(inputs, directions)))
    return (plus - minus) / (2 * FD_STEP)


def _random_direction(rng, x):
    """Standard normal entries times ``x``'s largest magnitude: a step is the same relative change at every scale.

    (With inputs of 1e-3 a unit direction would make the h^2 term of the trilinear causal dot product large.)
    """
    return rng.standard_normal(x.shape) * (float(np.max(np.abs(x), initial=0.0)) or 1.0)


def _assert_fd_matches(fd, terms, loss_magnitude, what):
    exact = float(np.sum(terms))
    tolerance = FD_RTOL * float(np.sum(np.abs(terms))) + FD_ATOL * loss_magnitude
    assert abs(fd - exact) <= tolerance, f"{what}: finite difference {fd!r} != gradient {exact!r} (tol {tolerance})"


@st.composite
def cdp_problems(draw, max_seqlen=8, with_dstate=None):
    """A causal dot product case with ``dout`` and ``dstate`` (None half the time)."""
    case = draw(linear_cases(max_seqlen=max_seqlen))
    rng = np.random.default_rng(draw(seeds))
    dout = rng.standard_normal(case.v.shape)
    if with_dstate is None:
        with_dstate = draw(st.booleans())
    dstate = rng.standard_normal(case.q.shape[:-2] + (case.q.shape[-1], case.v.shape[-1])) if with_dstate else None
    return case, dout, dstate


def _cdp_inputs(case):
    """``(q, k, v, S_0)``, with ``S_0 = 0`` standing in for None (the forward treats them alike)."""
    state_shape = case.q.shape[:-2] + (case.q.shape[-1], case.v.shape[-1])
    initial_state = np.zeros(state_shape) if case.initial_state is None else case.initial_state
    return case.q, case.k, case.v, initial_state


def _cdp_loss(dout, dstate):
    """``sum(dout * out) + sum(dstate * final_state)``: its gradient is the backward of ``dout`` and ``dstate``."""
    def loss(q, k, v, initial_state):
        out, state = causal_dot_product(q, k, v, initial_state=initial_state, return_state=True)
        return float(np.sum(dout * out) + (0.0 if dstate is None else np.sum(dstate * state)))
    return loss


def _cdp_gradient_bounds(case, dout, dstate):
    """Each gradient with every term made positive: what its rounding is relative to (also ``|loss|``'s scale)."""
    positive = [np.abs(x) for x in _cdp_inputs(case)]
    dstate = None if dstate is None else np.abs(dstate)
    return causal_dot_product_backward(np.abs(dout), *positive[:3], initial_state=positive[3], dstate=dstate)


def _cdp_loss_magnitude(case, dout, dstate):
    # sum |dout| |out| + |dstate| |state| <= sum over the terms of each product, i.e. <|v|, the bound of dv>
    # plus <|S_0|, the bound of dS_0>.
    bounds = _cdp_gradient_bounds(case, dout, dstate)
    return float(np.sum(np.abs(case.v) * bounds[2]) + np.sum(np.abs(_cdp_inputs(case)[3]) * bounds[3]))


_THE_CASES = object()


def _call(backward, case, dout, dstate, initial_state=_THE_CASES):
    initial_state = case.initial_state if initial_state is _THE_CASES else initial_state
    return backward(dout, case.q, case.k, case.v, initial_state=initial_state, dstate=dstate)


@pytest.mark.parametrize("name", CDP_BACKWARDS)
@given(problem=cdp_problems(), seed=seeds)
def test_causal_dot_product_gradients_equal_central_differences(name, problem, seed):
    case, dout, dstate = problem
    inputs = _cdp_inputs(case)
    gradients = _call(CDP_BACKWARDS[name], case, dout, dstate, initial_state=inputs[3])
    rng = np.random.default_rng(seed)
    directions = [_random_direction(rng, x) for x in inputs]
    loss, magnitude = _cdp_loss(dout, dstate), _cdp_loss_magnitude(case, dout, dstate)
    terms = [np.sum(g * d) for g, d in zip(gradients, directions)]
    _assert_fd_matches(_central_difference(loss, inputs, directions), terms, magnitude, "q, k, v, S_0")
    for index, what in enumerate(("dq", "dk", "dv", "dinitial_state")):
        only = [d if i == index else np.zeros_like(d) for i, d in enumerate(directions)]
        _assert_fd_matches(_central_difference(loss, inputs, only), [terms[index]], magnitude, what)


@given(problem=cdp_problems(), data=st.data())
def test_individual_causal_dot_product_gradient_entries_equal_central_differences(problem, data):
    case, dout, dstate = problem
    inputs = _cdp_inputs(case)
    gradients = _call(causal_dot_product_backward, case, dout, dstate, initial_state=inputs[3])
    loss, magnitude = _cdp_loss(dout, dstate), _cdp_loss_magnitude(case, dout, dstate)
    for index, (x, gradient) in enumerate(zip(inputs, gradients)):
        if x.size == 0:
            continue
        for _ in range(2):
            entry = data.draw(st.tuples(*(st.integers(0, n - 1) for n in x.shape)), label="entry")
            directions = [np.zeros_like(y) for y in inputs]
            directions[index][entry] = 1.0
            fd = _central_difference(loss, inputs, directions)
            _assert_fd_matches(fd, [gradient[entry]], magnitude, f"{('q', 'k', 'v', 'S_0')[index]}{list(entry)}")


@given(problem=cdp_problems(max_seqlen=40), chunk_size=block_sizes())
def test_recurrent_and_chunked_gradients_equal_the_definition_for_any_chunk_size(problem, chunk_size):
    case, dout, dstate = problem
    expected = _call(causal_dot_product_backward, case, dout, dstate)
    atols = [1e-13 * (1.0 + float(np.max(b, initial=0.0))) for b in _cdp_gradient_bounds(case, dout, dstate)]
    for actual in (
        _call(causal_dot_product_backward_recurrent, case, dout, dstate),
        causal_dot_product_backward_chunked(dout, case.q, case.k, case.v, chunk_size=chunk_size,
                                            initial_state=case.initial_state, dstate=dstate),
    ):
        assert len(actual) == len(expected) == (3 if case.initial_state is None else 4)
        for a, e, atol in zip(actual, expected, atols):
            assert a.dtype == np.float64
            assert_close(a, e, atol=atol)


@pytest.mark.parametrize("name", CDP_BACKWARDS)
@given(problem=cdp_problems(max_seqlen=16), data=st.data())
def test_two_pieces_with_the_state_gradient_carried_back_equal_the_whole(name, problem, data):
    """The first piece's final state is the second's initial state: its gradient is the second's dS_0."""
    case, dout, dstate = problem
    backward = CDP_BACKWARDS[name]
    split = data.draw(st.integers(0, case.q.shape[-2]), label="split")
    first, second = np.s_[..., :split, :], np.s_[..., split:, :]
    q, k, v, initial_state = _cdp_inputs(case)
    _, state = causal_dot_product(q[first], k[first], v[first], initial_state=initial_state, return_state=True)
    dq_2, dk_2, dv_2, dstate_1 = backward(dout[second], q[second], k[second], v[second],
                                          initial_state=state, dstate=dstate)
    dq_1, dk_1, dv_1, dinitial = backward(dout[first], q[first], k[first], v[first],
                                          initial_state=initial_state, dstate=dstate_1)
    expected = backward(dout, q, k, v, initial_state=initial_state, dstate=dstate)
    atols = [1e-13 * (1.0 + float(np.max(b, initial=0.0))) for b in _cdp_gradient_bounds(case, dout, dstate)]
    pieces = [np.concatenate(pair, axis=-2) for pair in ((dq_1, dq_2), (dk_1, dk_2), (dv_1, dv_2))] + [dinitial]
    for actual, e, atol in zip(pieces, expected, atols):
        assert_close(actual, e, atol=atol)


@pytest.mark.parametrize("name", CDP_BACKWARDS)
def test_dinitial_state_is_returned_only_for_an_initial_state(name):
    rng = np.random.default_rng(2)
    q, k, v, dout = (rng.standard_normal((2, 5, n)) for n in (3, 3, 4, 4))
    dstate = rng.standard_normal((2, 3, 4))
    assert len(CDP_BACKWARDS[name](dout, q, k, v)) == 3
    gradients = CDP_BACKWARDS[name](dout, q, k, v, initial_state=np.zeros((2, 3, 4)), dstate=dstate)
    assert len(gradients) == 4
    # S_0 adds q_i^T S_0 to every row and itself to the final state: dS_0 = q^T dout + dstate
    assert_close(gradients[3], np.swapaxes(q, -1, -2) @ dout + dstate, atol=1e-13)
    # with dstate and no initial state, the zero S_0 changes nothing: same dq, dk, dv
    for a, e in zip(CDP_BACKWARDS[name](dout, q, k, v, dstate=dstate), gradients[:3]):
        np.testing.assert_array_equal(a, e)


@st.composite
def layer_problems(draw, causal, max_seqlen=6):
    """Moderate linear attention inputs (``seqlen_k != seqlen_q`` unless causal) with ``dout`` and ``eps``."""
    leading = draw(st.sampled_from([(), (1,), (2, 2)]))
    seqlen_q = draw(seqlens(0, max_seqlen))
    seqlen_k = seqlen_q if causal else draw(seqlens(0, max_seqlen))
    features, values = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    rng = np.random.default_rng(draw(seeds))
    scale = st.sampled_from([0.1, 0.5, 1.0, 2.0])
    q = draw(scale) * rng.standard_normal(leading + (seqlen_q, features))
    k = draw(scale) * rng.standard_normal(leading + (seqlen_k, features))
    v = draw(scale) * rng.standard_normal(leading + (seqlen_k, values))
    dout = rng.standard_normal(leading + (seqlen_q, values))
    eps = draw(st.sampled_from([1e-6, 0.0, 1.0]))
    return q, k, v, dout, eps


@pytest.mark.parametrize("causal", [False, True])
@given(data=st.data(), seed=seeds)
def test_linear_attention_gradients_equal_central_differences(causal, data, seed):
    q, k, v, dout, eps = data.draw(layer_problems(causal), label="problem")
    gradients = linear_attention_backward(dout, q, k, v, causal=causal, eps=eps)
    rng = np.random.default_rng(seed)
    directions = [_random_direction(rng, x) for x in (q, k, v)]

    def loss(q, k, v):
        return float(np.sum(dout * linear_attention(q, k, v, causal=causal, eps=eps)))

    # phi > 0: each output row is a weighted mean of v rows (weights summing to <= 1), so |out| <= max|v|.
    magnitude = float(np.sum(np.abs(dout))) * float(np.max(np.abs(v), initial=0.0))
    terms = [np.sum(g * d) for g, d in zip(gradients, directions)]
    _assert_fd_matches(_central_difference(loss, (q, k, v), directions), terms, magnitude, "q, k, v")
    for index, (x, gradient) in enumerate(zip((q, k, v), gradients)):
        only = [d if i == index else np.zeros_like(d) for i, d in enumerate(directions)]
        _assert_fd_matches(_central_difference(loss, (q, k, v), only), [terms[index]], magnitude, "qkv"[index])
        if x.size:
            entry = data.draw(st.tuples(*(st.integers(0, n - 1) for n in x.shape)), label="entry")
            unit = [np.zeros_like(y) for y in (q, k, v)]
            unit[index][entry] = 1.0
            fd = _central_difference(loss, (q, k, v), unit)
            _assert_fd_matches(fd, [gradient[entry]], magnitude, f"{'qkv'[index]}{list(entry)}")


@pytest.mark.parametrize("eps", [0.0, 1e-6])
def test_rows_without_keys_pass_no_gradient_back(eps):
    rng = np.random.default_rng(3)
    q, dout = rng.standard_normal((2, 4, 3)), rng.standard_normal((2, 4, 5))
    dq, dk, dv = linear_attention_backward(dout, q, np.zeros((2, 0, 3)), np.zeros((2, 0, 5)), eps=eps)
    assert (dq == 0).all() and dk.shape == (2, 0, 3) and dv.shape == (2, 0, 5)


@given(problem=cdp_problems(max_seqlen=12), data=st.data())
def test_unbatched_inputs_equal_a_batch_of_one_head(problem, data):
    case, dout, dstate = problem
    if case.q.ndim != 2:
        case.q, case.k, case.v, dout = case.q[0, 0], case.k[0, 0], case.v[0, 0], dout[0, 0]
        case.initial_state = None if case.initial_state is None else case.initial_state[0, 0]
        dstate = None if dstate is None else dstate[0, 0]
    expand = (lambda x: None if x is None else x[None, None])
    for backward in CDP_BACKWARDS.values():
        gradients = _call(backward, case, dout, dstate)
        gradients_4d = backward(expand(dout), *(expand(x) for x in (case.q, case.k, case.v)),
                                initial_state=expand(case.initial_state), dstate=expand(dstate))
        for gradient, gradient_4d in zip(gradients, gradients_4d):
            np.testing.assert_array_equal(gradient, gradient_4d[0, 0])
    causal = data.draw(st.booleans(), label="causal")
    gradients = linear_attention_backward(dout, case.q, case.k, case.v, causal=causal)
    gradients_4d = linear_attention_backward(expand(dout), *(expand(x) for x in (case.q, case.k, case.v)),
                                             causal=causal)
    for gradient, gradient_4d in zip(gradients, gradients_4d):
        np.testing.assert_array_equal(gradient, gradient_4d[0, 0])


BAD_CDP_INPUTS = [
    ("dout", dict(dout=np.zeros((2, 5, 6)))),
    ("dout", dict(dout=np.zeros((2, 4, 7)))),
    ("dout", dict(dout=np.zeros((5, 7)))),
    ("dstate", dict(dstate=np.zeros((2, 7, 3)))),
    ("dstate", dict(dstate=np.zeros((3, 7)))),
    ("initial_state", dict(initial_state=np.zeros((2, 5, 3)))),
    ("q", dict(q=np.zeros(4))),
    ("k", dict(k=np.zeros((2, 6, 3)))),
    ("v", dict(v=np.zeros((2, 6, 7)))),
]


@pytest.mark.parametrize("function", [causal_dot_product_backward, causal_dot_product_backward_recurrent,
                                      causal_dot_product_backward_chunked])
@pytest.mark.parametrize("name, override", BAD_CDP_INPUTS)
def test_bad_causal_dot_product_backward_inputs_raise_value_error_naming_them(function, name, override):
    arguments = dict(dout=np.zeros((2, 5, 7)), q=np.zeros((2, 5, 3)), k=np.zeros((2, 5, 3)), v=np.zeros((2, 5, 7)),
                     initial_state=None, dstate=None)
    arguments.update(override)
    dout, q, k, v = (arguments.pop(key) for key in ("dout", "q", "k", "v"))
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        function(dout, q, k, v, **arguments)


@pytest.mark.parametrize("chunk_size", [0, -4, 2.0, True])
def test_bad_chunk_sizes_raise_value_error_naming_them(chunk_size):
    q = np.zeros((2, 5, 3))
    with pytest.raises(ValueError, match=r"\bchunk_size\b"):
        causal_dot_product_backward_chunked(q, q, q, q, chunk_size=chunk_size)


@pytest.mark.parametrize(
    "name, dout_shape, k_shape, v_shape, kwargs",
    [
        ("dout", (2, 5, 6), (2, 6, 3), (2, 6, 7), {}),
        ("dout", (2, 6, 7), (2, 6, 3), (2, 6, 7), {}),
        ("k", (2, 5, 7), (2, 6, 4), (2, 6, 7), {}),
        ("v", (2, 5, 7), (2, 6, 3), (2, 5, 7), {}),
        ("k", (2, 5, 7), (2, 6, 3), (2, 6, 7), {"causal": True}),
        ("causal", (2, 5, 7), (2, 6, 3), (2, 6, 7), {"causal": 1}),
        ("causal", (2, 5, 7), (2, 6, 3), (2, 6, 7), {"causal": "no"}),
        ("eps", (2, 5, 7), (2, 6, 3), (2, 6, 7), {"eps": -1.0}),
        ("eps", (2, 5, 7), (2, 6, 3), (2, 6, 7), {"eps": "1e-6"}),
        ("eps", (2, 5, 7), (2, 6, 3), (2, 6, 7), {"eps": np.nan}),
    ],
)
def test_bad_linear_attention_backward_inputs_raise_value_error_naming_them(name, dout_shape, k_shape, v_shape,
                                                                            kwargs):
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        linear_attention_backward(np.zeros(dout_shape), np.zeros((2, 5, 3)), np.zeros(k_shape), np.zeros(v_shape),
                                  **kwargs)


@pytest.mark.parametrize("backward, forward", [(causal_dot_product_backward, causal_dot_product),
                                               (causal_dot_product_backward_recurrent, causal_dot_product),
                                               (causal_dot_product_backward_chunked, causal_dot_product_chunked),
                                               (linear_attention_backward, linear_attention)])
def test_keyword_defaults_are_the_forwards(backward, forward):
    ours, theirs = inspect.signature(backward).parameters, inspect.signature(forward).parameters
    keywords = [name for name, p in ours.items() if p.kind is inspect.Parameter.KEYWORD_ONLY and name in theirs]
    assert keywords and all(ours[name].default == theirs[name].default for name in keywords)
