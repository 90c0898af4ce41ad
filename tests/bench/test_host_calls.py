"""scripts/host_calls.py runs (CPU, stubbed driver): the measure of the replayed calls' Python work stays usable as the
runtime it stubs changes (it had stopped at a launch attribute added later, unnoticed). Each case's line names a
positive number of microseconds and of Python calls; no time is asserted."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def test_host_calls_runs_every_case():
    pytest.importorskip("torch")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1",
               PYTHONPATH=os.pathsep.join([ROOT] + [p for p in sys.path if p]))
    result = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "host_calls.py"), "--calls", "100"],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line for line in result.stdout.splitlines()[1:] if line.strip()]
    names = [line.rsplit(None, 2)[0].strip() for line in lines]
    assert "flash_forward on wgmma_ws, four maps (replay)" in names and "flash_forward (replay)" in names
    assert len(lines) == 9
    for line in lines:
        us, calls = (float(x) for x in line.split()[-2:])
        assert us > 0 and calls > 0, line
