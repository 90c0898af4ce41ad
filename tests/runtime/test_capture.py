"""A process's very first call of each public function may be made inside a CUDA-graph capture (issue #27): it
must not synchronise, allocate outside the graph's pool or tune there, and the replayed graph gives the answer of
``reference``. Each case runs in a fresh Python process, so that nothing was compiled, planned or tuned before."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

_SCRIPT = """
import numpy as np, torch, numba_attn, reference
rng = np.random.default_rng(0)
x = [rng.standard_normal(SHAPE).astype(np.float32) for _ in range(3)]
t = [torch.tensor(a, device="cuda", dtype=torch.float16) for a in x]
x = [a.cpu().double().numpy() for a in t]
torch.cuda.synchronize()
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    got = CALL
graph.replay()
torch.cuda.synchronize()
expected = EXPECTED
got = got[0] if isinstance(got, tuple) else got
expected = expected[0] if isinstance(expected, tuple) else expected
error = np.linalg.norm(got.double().cpu().numpy() - expected) / np.linalg.norm(expected)
print("ERROR", error)
"""

CASES = {
    "flash_forward": ("(2, 4, 300, 64)", "numba_attn.flash_forward(*t, causal=True)",
                      "reference.attention(*x, causal=True)"),
    "flash_forward lse": ("(2, 4, 300, 128)", "numba_attn.flash_forward(*t, return_lse=True)",
                          "reference.attention(*x, return_lse=True)"),
    "flash_decode": ("(2, 8, 2000, 128)", "numba_attn.flash_decode(t[0][:, :, -1:], t[1], t[2])",
                     "reference.attention(x[0][:, :, -1:], x[1], x[2])"),
    "causal_dot_product": ("(2, 4, 300, 64)", "numba_attn.causal_dot_product(*[a * 0.3 for a in t])",
                           "reference.causal_dot_product(*[a * 0.3 for a in x])"),
    "linear_attention": ("(2, 4, 300, 64)", "numba_attn.linear_attention(*t)", "reference.linear_attention(*x)"),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(CASES))
def test_first_call_inside_a_capture(case, tmp_path):
    pytest.importorskip("torch")
    shape, call, expected = CASES[case]
    script = textwrap.dedent(_SCRIPT).replace("SHAPE", shape).replace("CALL", call).replace("EXPECTED", expected)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root] + os.environ.get("PYTHONPATH", "").split(os.pathsep)),
               NUMBA_ATTN_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("NUMBA_ATTN_AUTOTUNE", None)  # the default behaviour
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    error = float(done.stdout.split("ERROR")[-1])
    assert error < 3e-3, error
