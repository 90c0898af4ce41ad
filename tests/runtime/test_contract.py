"""The input contract of the public functions (issue #26): no crash, no silent wrong answer, the same answer as
`reference`. Tiny shapes: every call here runs a few simulated thread blocks at most."""
from __future__ import annotations

import inspect
import os
import subprocess
import sys

import numpy as np
import pytest

import numba_attn
import reference
from numba_attn.runtime.arguments import ArgumentTypeError
from numba_attn.runtime.device import SIMULATOR


def _rng(seed=0):
    return np.random.default_rng(seed)


def _arrays(*shapes, dtype=np.float32, seed=0):
    rng = _rng(seed)
    return tuple(rng.standard_normal(shape).astype(dtype) for shape in shapes)


def _rel(actual, expected) -> float:
    actual = np.asarray(actual, dtype=np.float64)
    return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30))


def _read_only(x: np.ndarray, how: str, tmp_path) -> np.ndarray:
    if how == "mmap":
        path = tmp_path / f"{id(x)}.npy"
        np.save(path, x)
        y = np.load(path, mmap_mode="r")
    elif how == "frombuffer":
        y = np.frombuffer(x.tobytes(), dtype=x.dtype).reshape(x.shape)
    else:
        y = x.copy()
        y.setflags(write=False)
    assert not y.flags.writeable
    return y


# -- 1. read-only inputs ----------------------------------------------------------------------------------------------
READ_ONLY_CALLS = {
    "flash_forward": (lambda q, k, v: numba_attn.flash_forward(q, k, v), reference.attention, np.float32),
    "flash_decode-fp16": (lambda q, k, v: numba_attn.flash_decode(q, k, v), reference.attention, np.float16),
    "causal_dot_product": (numba_attn.causal_dot_product, reference.causal_dot_product, np.float32),
    "linear_attention": (numba_attn.linear_attention, reference.linear_attention, np.float32),
}


@pytest.mark.parametrize("name", list(READ_ONLY_CALLS))
def test_read_only_inputs_are_accepted(name, tmp_path):
    fn, ref, dtype = READ_ONLY_CALLS[name]
    q, k, v = _arrays((1, 1, 3, 8), (1, 1, 3, 8), (1, 1, 3, 8), dtype=dtype)
    args = [_read_only(x, how, tmp_path) for x, how in zip((q, k, v), ("mmap", "frombuffer", "setflags"))]
    out = fn(*args)
    assert _rel(out, ref(q, k, v)) < (2e-3 if dtype == np.float16 else 1e-5)


def test_read_only_combine_lse_and_initial_state_are_accepted(tmp_path):
    o_parts, lse_parts = _arrays((2, 3, 8), (2, 3))
    out, lse = numba_attn.combine_lse(_read_only(o_parts, "mmap", tmp_path), _read_only(lse_parts, "setflags", tmp_path))
    ref_out, ref_lse = reference.combine_lse(o_parts, lse_parts)
    assert _rel(out, ref_out) < 1e-5 and _rel(lse, ref_lse) < 1e-5
    q, k, v, state = _arrays((3, 4), (3, 4), (3, 4), (4, 4), seed=1)
    out, final = numba_attn.causal_dot_product(q, k, v, initial_state=_read_only(state, "frombuffer", tmp_path),
                                               return_state=True)
    ref_out, ref_final = reference.causal_dot_product(q, k, v, initial_state=state, return_state=True)
    assert _rel(out, ref_out) < 1e-5 and _rel(final, ref_final) < 1e-5


def test_torch_cpu_bfloat16_tensors_are_accepted():
    """torch CPU bfloat16 tensors (which have no NumPy dtype) travel as their bits; the result is bfloat16 again.
    (Crashed with torch's 'Got unsupported ScalarType BFloat16' before.)"""
    torch = pytest.importorskip("torch")
    q, k, v = _arrays((1, 1, 3, 8), (1, 1, 5, 8), (1, 1, 5, 8))
    tq, tk, tv = (torch.from_numpy(x).to(torch.bfloat16) for x in (q, k, v))
    out = numba_attn.flash_forward(tq, tk, tv)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.device.type == "cpu"
    exact = [x.float().numpy() for x in (tq, tk, tv)]
    assert _rel(out.float().numpy(), reference.attention(*exact)) < 1e-2
    into = torch.empty_like(tq)
    assert numba_attn.flash_forward(tq, tk, tv, out=into) is into
    assert torch.equal(into, out)


# -- 2. outputs that overlap inputs or themselves ---------------------------------------------------------------------
def _device(x):
    from numba import cuda

    return cuda.to_device(x)


def _strided_like(base, shape, strides):
    """A view of ``base``'s memory with this shape and these byte strides, of ``base``'s kind (host or device)."""
    as_strided = np.lib.stride_tricks.as_strided
    if isinstance(base, np.ndarray):
        return as_strided(base, shape, strides)
    if SIMULATOR:
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        return FakeCUDAArray(as_strided(base._ary, shape, strides))
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

    return DeviceNDArray(shape, strides, base.dtype, gpu_data=base.gpu_data)


@pytest.mark.parametrize("kind", ["host", "device"])
@pytest.mark.parametrize("alias", ["q", "k", "v", "half-of-k"])
def test_out_overlapping_an_input_is_rejected(kind, alias):
    q, k, v = _arrays((1, 1, 4, 8), (1, 1, 4, 8), (1, 1, 4, 8))
    wide = np.concatenate([k, v], axis=-1)  # k and v side by side in one buffer
    if kind == "device":
        q, wide = _device(q), _device(wide)
    k, v = wide[:, :, :, :8], wide[:, :, :, 8:]
    out = {"q": q, "k": k, "v": v, "half-of-k": wide[:, :, :, 4:12]}[alias]
    name = "k" if alias == "half-of-k" else alias
    with pytest.raises(ValueError, match=f"out: shares memory with {name}"):
        numba_attn.flash_forward(q, k, v, out=out)


def test_out_interleaved_with_inputs_but_disjoint_is_accepted():
    q, k, v = _arrays((1, 1, 4, 8), (1, 1, 4, 8), (1, 1, 4, 8))
    packed = _device(np.concatenate([k, v, np.full_like(q, np.nan)], axis=-1))  # k | v | out in each row
    numba_attn.flash_forward(_device(q), packed[:, :, :, :8], packed[:, :, :, 8:16], out=packed[:, :, :, 16:])
    host = packed.copy_to_host()
    assert _rel(host[..., 16:], reference.attention(q, k, v)) < 1e-5
    np.testing.assert_array_equal(host[..., :16], np.concatenate([k, v], axis=-1))  # inputs untouched


@pytest.mark.parametrize("kind", ["host", "device"])
@pytest.mark.parametrize("strides", [(0, 0, 0, 4), (0, 0, 4, 4)], ids=["zero-row-stride", "rows-overlap"])
def test_out_with_overlapping_elements_is_rejected(kind, strides):
    q, k, v = _arrays((1, 1, 4, 8), (1, 1, 4, 8), (1, 1, 4, 8))
    base = np.zeros(64, np.float32)
    if kind == "device":
        q, k, v, base = (_device(x) for x in (q, k, v, base))
    out = _strided_like(base, (1, 1, 4, 8), strides)
    with pytest.raises(ValueError, match="out: its elements overlap"):
        numba_attn.flash_forward(q, k, v, out=out)


def test_read_only_host_out_is_rejected():
    q, k, v = _arrays((1, 1, 4, 8), (1, 1, 4, 8), (1, 1, 4, 8))
    out = np.empty_like(q)
    out.setflags(write=False)
    with pytest.raises(ValueError, match="out: must be writeable"):
        numba_attn.flash_forward(q, k, v, out=out)


def test_numba_device_arrays_in_give_numba_device_arrays_out():
    """The device-array path (used in place, outputs of the same kind) runs under the simulator too."""
    q, k, v = _arrays((1, 2, 3, 8), (1, 1, 5, 8), (1, 1, 5, 8))
    out, lse = numba_attn.flash_decode(_device(q), _device(k), _device(v), return_lse=True)
    ref_out, ref_lse = reference.attention(q, k, v, return_lse=True)
    assert _rel(out.copy_to_host(), ref_out) < 1e-5 and _rel(lse.copy_to_host(), ref_lse) < 1e-5
    o_parts, lse_parts = reference.split_kv_attention(q, k, v, 2, dtype=np.float32)
    out, lse = numba_attn.combine_lse(_device(o_parts), _device(lse_parts))
    assert _rel(out.copy_to_host(), ref_out) < 1e-5 and _rel(lse.copy_to_host(), ref_lse) < 1e-5
    lq, lk, lv = _arrays((1, 2, 3, 4), (1, 2, 3, 4), (1, 2, 3, 4), seed=1)
    out = numba_attn.causal_dot_product(_device(lq), _device(lk), _device(lv))
    assert _rel(out.copy_to_host(), reference.causal_dot_product(lq, lk, lv)) < 1e-5


# -- 4. flags are bools, numbers are real numbers ---------------------------------------------------------------------
def _small():
    return _arrays((1, 1, 2, 4), (1, 1, 3, 4), (1, 1, 3, 4))


FLAG_ARGUMENTS = [
    (numba_attn.flash_forward, "causal"), (numba_attn.flash_forward, "return_lse"),
    (numba_attn.flash_forward, "allow_tf32"), (numba_attn.flash_decode, "causal"),
    (numba_attn.flash_decode, "return_lse"), (numba_attn.causal_dot_product, "return_state"),
    (numba_attn.causal_dot_product, "allow_tf32"), (numba_attn.linear_attention, "causal"),
    (numba_attn.linear_attention, "allow_tf32"),
]


@pytest.mark.parametrize("fn, name", FLAG_ARGUMENTS, ids=[f"{fn.__name__}-{name}" for fn, name in FLAG_ARGUMENTS])
@pytest.mark.parametrize("value", ["no", 1, 0, None, np.array(True)], ids=["str", "one", "zero", "None", "0d-array"])
def test_flags_must_be_bools(fn, name, value):
    q, k, v = _small()
    if fn in (numba_attn.causal_dot_product, numba_attn.linear_attention):
        k, v = q, q
    with pytest.raises(TypeError, match=f"^{name}: expected True or False"):
        fn(q, k, v, **{name: value})


@pytest.mark.parametrize("fn", [numba_attn.flash_forward, numba_attn.flash_decode])
@pytest.mark.parametrize("value", [True, np.bool_(False), "0.1", 1j, [0.1]])
def test_sm_scale_must_be_a_real_number(fn, value):
    q, k, v = _small()
    with pytest.raises(TypeError, match="^sm_scale: expected a finite real number"):
        fn(q, k, v, sm_scale=value)


@pytest.mark.parametrize("value, error", [(True, TypeError), (2.0, TypeError), ("2", TypeError),
                                          (np.int64(0), ValueError)])
def test_num_splits_type_and_range(value, error):
    q, k, v = _small()
    with pytest.raises(error, match="^num_splits: expected an integer >= 1"):
        numba_attn.flash_decode(q, k, v, num_splits=value)


@pytest.mark.parametrize("value, error", [(True, TypeError), ("1e-6", TypeError), (None, TypeError),
                                          (-1.0, ValueError), (float("inf"), ValueError)])
def test_eps_type_and_range(value, error):
    q, = _arrays((1, 1, 3, 4))
    with pytest.raises(error, match="^eps:"):
        numba_attn.linear_attention(q, q, q, eps=value)


@pytest.mark.parametrize("fn, backends", [(numba_attn.flash_forward, "simt"), (numba_attn.causal_dot_product, "chunked"),
                                          (numba_attn.linear_attention, "chunked")])
def test_backend_must_be_a_string(fn, backends):
    q, = _arrays((1, 1, 3, 4))
    with pytest.raises(TypeError, match="^backend: expected one of"):
        fn(q, q, q, backend=[backends])


def test_type_errors_are_value_errors_too():
    """Wrong types raised ValueError before they were told apart: callers catching that still catch them."""
    assert issubclass(ArgumentTypeError, TypeError) and issubclass(ArgumentTypeError, ValueError)
    assert issubclass(reference._shapes.ArgumentTypeError, TypeError)
    assert issubclass(reference._shapes.ArgumentTypeError, ValueError)


def test_numpy_bools_and_scalars_are_accepted():
    q, k, v = _small()
    out, lse = numba_attn.flash_forward(q, k, v, causal=np.bool_(True), sm_scale=np.float32(0.5),
                                        return_lse=np.True_)
    ref_out, ref_lse = reference.attention(q, k, v, causal=True, sm_scale=0.5, return_lse=True)
    assert _rel(out, ref_out) < 1e-5 and _rel(lse, ref_lse) < 1e-5


@pytest.mark.parametrize(
    "fn, kwargs",
    [(reference.attention, {"causal": "no"}), (reference.attention, {"return_lse": 1}),
     (reference.attention, {"sm_scale": True}), (reference.attention, {"sm_scale": "0.1"}),
     (reference.flash_attention_v2, {"causal": None}), (reference.linear_attention, {"causal": "yes"}),
     (reference.linear_attention, {"eps": True}), (reference.causal_dot_product, {"return_state": 1})],
)
def test_reference_checks_flags_and_numbers_the_same_way(fn, kwargs):
    q, = _arrays((3, 4))
    with pytest.raises(TypeError, match=f"^{next(iter(kwargs))} must be"):
        fn(q, q, q, **kwargs)


# -- 5. scales that overflow in float32 --------------------------------------------------------------------------------
@pytest.mark.parametrize("fn", [numba_attn.flash_forward, numba_attn.flash_decode])
@pytest.mark.parametrize("value", [1e39, -1e39, 3e38, float("inf"), float("nan")])
def test_sm_scale_overflowing_float32_is_rejected(fn, value):
    q, k, v = _small()
    with pytest.raises(ValueError, match="^sm_scale:"):
        fn(q, k, v, sm_scale=value)


def test_eps_overflowing_float32_is_rejected():
    q, = _arrays((1, 1, 3, 4))
    with pytest.raises(ValueError, match="^eps: .* too large"):
        numba_attn.linear_attention(q, q, q, eps=1e39)


# -- 7. arguments that are no arrays ----------------------------------------------------------------------------------
@pytest.mark.parametrize("o_parts, lse_parts, name", [([[0.0]], np.zeros(1, np.float32), "o_parts"),
                                                      (None, None, "o_parts"),
                                                      (np.zeros((2, 3, 4), np.float32), [0.0], "lse_parts")])
def test_combine_lse_non_arrays_raise_type_error(o_parts, lse_parts, name):
    with pytest.raises(TypeError, match=f"^{name}: expected a NumPy array"):
        numba_attn.combine_lse(o_parts, lse_parts)


@pytest.mark.parametrize("fn", [numba_attn.flash_forward, numba_attn.flash_decode, numba_attn.causal_dot_product,
                                numba_attn.linear_attention])
@pytest.mark.parametrize("position", [0, 1, 2])
def test_non_arrays_raise_type_error_naming_the_argument(fn, position):
    args = list(_arrays((1, 1, 3, 4), (1, 1, 3, 4), (1, 1, 3, 4)))
    args[position] = args[position].tolist()
    with pytest.raises(TypeError, match=f"^{'qkv'[position]}: expected a NumPy array"):
        fn(*args)


# -- 9. the same defaults as reference ---------------------------------------------------------------------------------
PAIRS = [(numba_attn.flash_forward, reference.attention), (numba_attn.flash_decode, reference.attention_with_kvcache),
         (numba_attn.flash_forward_varlen, reference.attention_varlen),
         (numba_attn.combine_lse, reference.combine_lse),
         (numba_attn.causal_dot_product, reference.causal_dot_product),
         (numba_attn.linear_attention, reference.linear_attention),
         (numba_attn.causal_dot_product_backward, reference.causal_dot_product_backward),
         (numba_attn.linear_attention_backward, reference.linear_attention_backward)]


@pytest.mark.parametrize("fn, ref", PAIRS, ids=[fn.__name__ for fn, _ in PAIRS])
def test_defaults_equal_references(fn, ref):
    ours, theirs = inspect.signature(fn).parameters, inspect.signature(ref).parameters
    shared = [name for name in ours if name in theirs]
    assert shared[:2] == list(ours)[:2]  # the arrays come first, in the same order
    for name in shared:
        assert ours[name].default == theirs[name].default, name


def test_linear_attention_defaults_to_non_causal():
    q, k, v = _arrays((1, 1, 4, 4), (1, 1, 4, 4), (1, 1, 4, 4))
    expected = reference.linear_attention(q, k, v, causal=False)
    assert _rel(numba_attn.linear_attention(q, k, v), expected) < 1e-5
    assert _rel(expected, reference.linear_attention(q, k, v, causal=True)) > 1e-2  # the defaults matter


def test_non_causal_linear_attention_takes_other_key_lengths():
    q, k, v = _arrays((1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 6))
    assert _rel(numba_attn.linear_attention(q, k, v), reference.linear_attention(q, k, v)) < 1e-5
    with pytest.raises(ValueError, match=r"^k: \(batch, heads, seqlen\) must equal q's"):
        numba_attn.linear_attention(q, k, v, causal=True)
    with pytest.raises(ValueError, match=r"^v: \(batch, heads, seqlen\) must equal k's"):
        numba_attn.linear_attention(q, k, v[:, :, :4])


def test_non_causal_linear_attention_without_keys_gives_zeros():
    q, = _arrays((1, 1, 3, 4))
    empty = np.zeros((1, 1, 0, 4), np.float32)
    np.testing.assert_array_equal(numba_attn.linear_attention(q, empty, empty), np.zeros((1, 1, 3, 4)))


# -- 10. numba.cuda imported first on a machine without a GPU ---------------------------------------------------------
@pytest.mark.skipif(not SIMULATOR, reason="a GPU is visible: importing numba.cuda first is fine")
def test_numba_cuda_imported_first_without_a_gpu_says_what_to_do():
    env = {key: value for key, value in os.environ.items() if key != "NUMBA_ENABLE_CUDASIM"}
    from numba_attn.runtime import device

    if device._driver_sees_a_gpu():
        pytest.skip("the driver sees a GPU (tests forced onto the simulator)")
    result = subprocess.run([sys.executable, "-c", "from numba import cuda; import numba_attn"], env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "NUMBA_ENABLE_CUDASIM=1" in result.stderr and "import numba_attn" in result.stderr, result.stderr
    ok = subprocess.run([sys.executable, "-c", "from numba import cuda; import numba_attn"],
                        env=dict(env, NUMBA_ENABLE_CUDASIM="1"), capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr


# -- several libraries, several devices (GPU) -------------------------------------------------------------------------
@pytest.mark.gpu
def test_device_arrays_of_two_libraries_are_rejected():
    torch = pytest.importorskip("torch")
    cupy = pytest.importorskip("cupy")
    q, k, v = _arrays((1, 2, 4, 8), (1, 2, 5, 8), (1, 2, 5, 8))
    with pytest.raises(ValueError, match="k: is a torch tensor but q is a CuPy array"):
        numba_attn.flash_forward(cupy.asarray(q), torch.from_numpy(k).cuda(), torch.from_numpy(v).cuda())
    with pytest.raises(ValueError, match="initial_state: is a CuPy array but q is a torch tensor"):
        numba_attn.causal_dot_product(*(torch.from_numpy(x).cuda() for x in (q, q, q)),
                                      initial_state=cupy.zeros((1, 2, 8, 8), cupy.float32))
    # host arrays may mix (they are copied): NumPy q, torch CPU k and v
    out = numba_attn.flash_forward(q, torch.from_numpy(k), torch.from_numpy(v))
    assert _rel(out, reference.attention(q, k, v)) < 1e-5


def _five_calls(to_device, to_host):
    """Every public function on arrays made by ``to_device``; relative errors against reference."""
    q, k, v = _arrays((1, 4, 16, 32), (1, 2, 64, 32), (1, 2, 64, 32), dtype=np.float16)
    dq, dk, dv = (to_device(x) for x in (q, k, v))
    errors = {"flash_forward": _rel(to_host(numba_attn.flash_forward(dq, dk, dv, causal=True)),
                                    reference.attention(q, k, v, causal=True))}
    for repeat in range(2):  # the second call takes the cached plan
        out, lse = numba_attn.flash_decode(dq[:, :, -1:], dk, dv, return_lse=True)
        ref_out, ref_lse = reference.attention(q[:, :, -1:], k, v, return_lse=True)
        errors[f"flash_decode {repeat}"] = max(_rel(to_host(out), ref_out), _rel(to_host(lse), ref_lse))
    o_parts, lse_parts = reference.split_kv_attention(q, k, v, 3, dtype=np.float32)
    out, lse = numba_attn.combine_lse(to_device(o_parts), to_device(lse_parts))
    ref_out, ref_lse = reference.combine_lse(o_parts, lse_parts)
    errors["combine_lse"] = max(_rel(to_host(out), ref_out), _rel(to_host(lse), ref_lse))
    lq, lk, lv = (to_device(x) for x in _arrays((1, 2, 64, 32), (1, 2, 64, 32), (1, 2, 64, 16), seed=3))
    hq, hk, hv = (to_host(x) for x in (lq, lk, lv))
    state = to_device(np.ones((1, 2, 32, 16), np.float32))
    out, final = numba_attn.causal_dot_product(lq, lk, lv, initial_state=state, return_state=True)
    ref_out, ref_final = reference.causal_dot_product(hq, hk, hv, initial_state=np.ones((1, 2, 32, 16)),
                                                      return_state=True)
    errors["causal_dot_product"] = max(_rel(to_host(out), ref_out), _rel(to_host(final), ref_final))
    errors["linear_attention"] = _rel(to_host(numba_attn.linear_attention(lq, lk, lv, causal=True)),
                                      reference.linear_attention(hq, hk, hv, causal=True))
    return errors


@pytest.mark.gpu
def test_arrays_on_another_device_than_the_current_one():
    """Arrays on GPU 1 while GPU 0 is current: every call runs on GPU 1 (scratch, placeholders, pool counters,
    launchers and raised shared-memory limits of that device) and GPU 0 stays current."""
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    from numba_attn.runtime.device import current_device_id

    for first, second in ((0, 1), (1, 0)):  # each device current while the arrays live on the other
        torch.cuda.set_device(first)
        numba_attn.flash_forward(*(torch.zeros((1, 1, 4, 8), device=f"cuda:{first}") for _ in range(3)))
        errors = _five_calls(lambda x: torch.from_numpy(np.ascontiguousarray(x)).to(f"cuda:{second}"),
                             lambda t: t.float().cpu().numpy())
        assert current_device_id() == first and torch.cuda.current_device() == first
        assert all(error < 5e-3 for error in errors.values()), errors


@pytest.mark.gpu
def test_calls_from_a_thread_without_a_current_context():
    """A fresh thread has no current CUDA context: the call makes the arrays' device current for itself."""
    cupy = pytest.importorskip("cupy")
    import threading

    from numba_attn.runtime import device

    q, k, v = _arrays((1, 4, 16, 32), (1, 2, 64, 32), (1, 2, 64, 32), dtype=np.float16)
    dq, dk, dv = (cupy.asarray(x) for x in (q, k, v))
    cupy.cuda.get_current_stream().synchronize()
    found = {}

    def work():
        found["before"] = device._driver_current_device()
        found["out"] = numba_attn.flash_forward(dq, dk, dv)
        found["decoded"] = numba_attn.flash_decode(dq[:, :, -1:], dk, dv)
        cupy.cuda.Device(0).synchronize()

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert found["before"] == -1
    assert _rel(cupy.asnumpy(found["out"]), reference.attention(q, k, v)) < 5e-3
    assert _rel(cupy.asnumpy(found["decoded"]), reference.attention(q[:, :, -1:], k, v)) < 5e-3


# -- 11. the README's first example runs anywhere ---------------------------------------------------------------------
def test_readme_numpy_example_runs(capsys):
    import pathlib
    import re

    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    example = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    assert "cupy" not in example and "torch" not in example  # the first example needs no GPU library
    exec(compile(example, "README.md", "exec"), {})
    assert float(capsys.readouterr().out) < 1e-5
