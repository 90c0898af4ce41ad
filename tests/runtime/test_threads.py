"""Calls from several Python threads at once give the answers of `reference` (issue #26 item 3).

Under the simulator the launches queue on one lock (the simulator runs one kernel at a time); on a GPU the threads
launch concurrently, each on its own stream, and share the package's caches (plans, launchables, autotuner).
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import numba_attn
import reference

THREADS = 8


def _rel(actual, expected) -> float:
    actual = np.asarray(actual, dtype=np.float64)
    return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30))


def _job(index: int, shape_q, shape_k, to_library=lambda x: x, to_numpy=np.asarray):
    """One thread's call: the function and dtype cycle with ``index``. Returns (relative error, tolerance, label).
    Attention takes ``shape_q`` queries against ``shape_k`` keys (GQA when the head counts differ); the linear
    functions take ``shape_q`` for q, k and v."""
    rng = np.random.default_rng(index)
    dtype = (np.float32, np.float16)[index % 2]
    kind = index // 2 % 4
    linear = kind >= 2
    q = rng.standard_normal(shape_q).astype(dtype)
    k, v = (rng.standard_normal(shape_q if linear else shape_k).astype(dtype) for _ in range(2))
    lq, lk, lv = (to_library(x) for x in (q, k, v))
    if kind == 0:
        out, expected = numba_attn.flash_forward(lq, lk, lv, causal=True), reference.attention(q, k, v, causal=True)
    elif kind == 1:
        out, lse = numba_attn.flash_decode(lq[..., -1:, :], lk, lv, return_lse=True)
        expected, expected_lse = reference.attention(q[..., -1:, :], k, v, return_lse=True)
        assert _rel(to_numpy(lse), expected_lse) < 1e-4
    elif kind == 2:
        out, expected = numba_attn.causal_dot_product(lq, lk, lv), reference.causal_dot_product(q, k, v)
    else:
        out, expected = numba_attn.linear_attention(lq, lk, lv), reference.linear_attention(q, k, v)
    tolerance = 5e-3 if dtype == np.float16 else 1e-4
    return _rel(to_numpy(out), expected), tolerance, f"thread {index}: {['forward', 'decode', 'cdp', 'linear'][kind]}"


def _run_threads(job):
    barrier = threading.Barrier(THREADS)

    def start(index):
        barrier.wait()  # all threads call at once
        return job(index)

    with ThreadPoolExecutor(THREADS) as pool:
        results = list(pool.map(start, range(THREADS)))
    for error, tolerance, label in results:
        assert error < tolerance, (label, error)


def test_threads_mixed_functions_and_dtypes():
    _run_threads(lambda index: _job(index, (1, 2, 3, 8), (1, 1, 4, 8)))


@pytest.mark.gpu
def test_threads_on_the_gpu_with_torch_streams():
    torch = pytest.importorskip("torch")

    def job(index):
        stream = torch.cuda.Stream()
        results = []
        with torch.cuda.stream(stream):
            for repeat in range(4):  # several calls per thread, planned and checked paths alike
                results.append(_job(8 * repeat + index, (2, 8, 256, 64), (2, 4, 512, 64),
                                    to_library=lambda x: torch.from_numpy(x).cuda(),
                                    to_numpy=lambda t: (torch.cuda.current_stream().synchronize(),
                                                        t.float().cpu().numpy())[1]))
        return max(results, key=lambda r: r[0] / r[1])

    _run_threads(job)


@pytest.mark.gpu
def test_threads_on_the_gpu_with_cupy_and_host_arrays():
    cupy = pytest.importorskip("cupy")

    def job(index):
        if index % 2:
            return _job(index, (1, 4, 128, 64), (1, 2, 256, 64))  # NumPy in, NumPy out
        with cupy.cuda.Stream(non_blocking=True):
            return _job(index, (1, 4, 128, 64), (1, 2, 256, 64), to_library=cupy.asarray,
                        to_numpy=lambda x: cupy.asnumpy(x, stream=cupy.cuda.get_current_stream()))

    _run_threads(job)
