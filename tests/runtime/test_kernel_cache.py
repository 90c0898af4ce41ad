"""The on-disk kernel cache of `runtime.kernel_cache`: the fingerprint, the source hash, the files, the switch; on a
GPU, a kernel compiled in one process and loaded in the next."""
from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass

import numpy as np
import pytest

from numba_attn.runtime import kernel_cache

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: a module global the test kernels read (monkeypatched by one test)
OFFSET = 3


@dataclass(frozen=True)
class _Config:
    rows: int
    scale: float


def _double(x):
    return 2 * x


def _triple(x):
    return 3 * x


def _scaled_by(factor):
    def scaled(x):
        return factor * x

    return scaled


def _build(rows=4, helper=_double, config=_Config(8, 0.5), dtype=np.dtype(np.float32)):
    """A kernel-shaped closure: constants from the configuration, a helper function, a module global."""
    ROWS = rows
    HELPER = helper
    CONFIG = config
    ZERO = dtype.type(0)

    def kernel(x, out):
        for i in range(ROWS):
            out[i] = HELPER(x[i]) + OFFSET + CONFIG.scale + ZERO

    return kernel


def _from_source(body: str):
    namespace = {"OFFSET": OFFSET}
    exec(textwrap.dedent(body), namespace)
    return namespace["kernel"]


# -- the fingerprint ---------------------------------------------------------------------------------------------------
def test_same_configuration_gives_the_same_fingerprint():
    a, b = _build(), _build()
    assert a is not b
    assert kernel_cache.fingerprint(a) == kernel_cache.fingerprint(b) is not None


def test_changed_closure_value_changes_the_fingerprint():
    base = kernel_cache.fingerprint(_build())
    assert kernel_cache.fingerprint(_build(rows=5)) != base
    assert kernel_cache.fingerprint(_build(config=_Config(8, 0.25))) != base
    assert kernel_cache.fingerprint(_build(dtype=np.dtype(np.float64))) != base
    # 4 and 4.0 compile differently (an integer and a float constant)
    assert kernel_cache.fingerprint(_build(rows=4.0)) != base


def test_changed_constant_changes_the_fingerprint():
    one = _from_source("def kernel(x):\n    x[0] = 1.5 + OFFSET\n")
    same = _from_source("def kernel(x):\n    x[0] = 1.5 + OFFSET\n")
    other = _from_source("def kernel(x):\n    x[0] = 2.5 + OFFSET\n")
    assert kernel_cache.fingerprint(one) == kernel_cache.fingerprint(same)
    assert kernel_cache.fingerprint(one) != kernel_cache.fingerprint(other)


def test_changed_global_changes_the_fingerprint(monkeypatch):
    kernel = _build()
    before = kernel_cache.fingerprint(kernel)
    monkeypatch.setattr(sys.modules[__name__], "OFFSET", 4)
    assert kernel_cache.fingerprint(kernel) != before
    monkeypatch.setattr(sys.modules[__name__], "OFFSET", 3)
    assert kernel_cache.fingerprint(kernel) == before


def test_changed_nested_function_changes_the_fingerprint():
    base = kernel_cache.fingerprint(_build())
    assert kernel_cache.fingerprint(_build(helper=_triple)) != base
    # the same code with another closure value, two levels down
    twice = kernel_cache.fingerprint(_build(helper=_scaled_by(2)))
    assert kernel_cache.fingerprint(_build(helper=_scaled_by(2))) == twice
    assert kernel_cache.fingerprint(_build(helper=_scaled_by(3))) != twice


def test_module_attributes_the_code_reads_count():
    """``mod.NAME`` in a kernel is frozen into the code: a module of the caller counts by the attributes named."""
    import types

    def make(value):
        module = types.ModuleType("kernel_cache_test_module")
        module.LIMIT = value
        module.unused = object()  # not named by the code: not keyed (an object would be unkeyable)

        def kernel(x):
            x[0] = module.LIMIT

        return kernel

    assert kernel_cache.fingerprint(make(1)) == kernel_cache.fingerprint(make(1)) is not None
    assert kernel_cache.fingerprint(make(1)) != kernel_cache.fingerprint(make(2))


def test_a_library_module_under_another_name_keys_alike():
    """``from numba import types`` gives the module ``numba.types`` or ``numba.core.types`` depending on what a
    process imported before (seen on the GPU: the backward's kernels missed the cache in every second process)."""
    import numba.core.types as core_types
    import numba.types as shim_types

    def make(types_module):
        def kernel(x):
            x[0] = types_module.intp

        return kernel

    assert core_types.__name__ != shim_types.__name__
    assert kernel_cache.fingerprint(make(core_types)) == kernel_cache.fingerprint(make(shim_types)) is not None


def test_recursive_functions_have_a_fingerprint():
    def kernel(x):
        return _even(x)

    assert kernel_cache.fingerprint(kernel) == kernel_cache.fingerprint(kernel) is not None


def _even(n):
    return True if n == 0 else _odd(n - 1)


def _odd(n):
    return False if n == 0 else _even(n - 1)


class _Plain:
    pass


@pytest.mark.parametrize("value", [[1, 2], {"a": 1}, object(), _Plain(), _Plain, (1, object()),
                                   functools.partial(_double, 1), _Config(1, 1.0).__repr__])
def test_unkeyable_cell_means_no_fingerprint(value):
    HELD = value

    def kernel(x):
        x[0] = HELD

    assert kernel_cache.fingerprint(kernel) is None
    assert kernel_cache.explain(kernel)


def test_mutable_dataclass_is_unkeyable():
    @dataclass
    class Loose:
        rows: int

    config = Loose(4)

    def kernel(x):
        x[0] = config.rows

    assert kernel_cache.fingerprint(kernel) is None
    assert "mutable dataclass" in kernel_cache.explain(kernel)


def _load_as(name: str):
    """This file as a module of another name (the same name in two processes)."""
    spec = importlib.util.spec_from_file_location(name, os.path.abspath(__file__))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (its dataclass looks itself up there)
    spec.loader.exec_module(module)
    return module


def test_fingerprint_is_the_same_in_another_process():
    code = ("import importlib.util, sys\n"
            "spec = importlib.util.spec_from_file_location('kernel_cache_probe', {path!r})\n"
            "t = sys.modules['kernel_cache_probe'] = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(t)\n"
            "from numba_attn.runtime import kernel_cache\n"
            "print(kernel_cache.fingerprint(t._build(helper=t._scaled_by(2))))\n"
            ).format(path=os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONHASHSEED="7")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    probe = _load_as("kernel_cache_probe")
    assert res.stdout.strip() == kernel_cache.fingerprint(probe._build(helper=probe._scaled_by(2))) != "None"


def test_options_key_refuses_linked_files():
    assert kernel_cache.options_key({"launch_bounds": (128, 2), "link": (), "extensions": []}) is not None
    assert kernel_cache.options_key({"link": ["extra.cu"]}) is None
    two, one = ({"launch_bounds": (128, blocks)} for blocks in (2, 1))
    assert kernel_cache.options_key(two) != kernel_cache.options_key(one)


# -- the package's source ----------------------------------------------------------------------------------------------
def test_source_hash_follows_python_files_only(tmp_path):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "a.py").write_text("A = 1\n")
    (tmp_path / "pkg" / "sub" / "b.py").write_text("B = 2\n")
    first = kernel_cache.source_hash(str(tmp_path / "pkg"))
    assert kernel_cache.source_hash(str(tmp_path / "pkg")) == first
    (tmp_path / "pkg" / "notes.txt").write_text("not source")
    (tmp_path / "pkg" / "__pycache__").mkdir()
    (tmp_path / "pkg" / "__pycache__" / "a.py").write_text("ignored")
    assert kernel_cache.source_hash(str(tmp_path / "pkg")) == first
    (tmp_path / "pkg" / "sub" / "b.py").write_text("B = 3\n")
    edited = kernel_cache.source_hash(str(tmp_path / "pkg"))
    assert edited != first
    (tmp_path / "pkg" / "sub" / "b.py").rename(tmp_path / "pkg" / "b.py")  # same contents, another path
    assert kernel_cache.source_hash(str(tmp_path / "pkg")) not in (first, edited)


def test_package_hash_covers_the_package():
    import numba_attn

    assert kernel_cache.package_hash() == kernel_cache.source_hash(os.path.dirname(numba_attn.__file__))


# -- the files ---------------------------------------------------------------------------------------------------------
def test_store_and_load_round_trip(tmp_path):
    path = str(tmp_path / "kernels" / "k.nbk")
    payload = {"ptx": "// code", "cubin": {(9, 0, "a"): b"\x7fELF" + bytes(range(256))}, "name": "kernel"}
    assert kernel_cache.save_object(path, "key-1", payload)
    assert kernel_cache.load_object(path, "key-1") == payload
    assert kernel_cache.load_object(path, "key-2") is None  # another key in the file: a miss
    assert kernel_cache.load_object(str(tmp_path / "kernels" / "missing.nbk"), "key-1") is None
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == ["k.nbk"]  # no temporary file left behind


def test_damaged_file_is_a_miss(tmp_path):
    path = str(tmp_path / "k.nbk")
    assert kernel_cache.save_object(path, "key", {"cubin": b"x" * 1000})
    data = bytearray(open(path, "rb").read())
    flipped = bytearray(data)
    flipped[-10] ^= 0x40  # one bit of the cubin
    open(path, "wb").write(bytes(flipped))
    assert kernel_cache.load_object(path, "key") is None
    open(path, "wb").write(bytes(data[: len(data) // 2]))  # truncated
    assert kernel_cache.load_object(path, "key") is None
    open(path, "wb").write(b"")
    assert kernel_cache.load_object(path, "key") is None
    open(path, "wb").write(bytes(data))  # and a rewrite mends it
    assert kernel_cache.load_object(path, "key") == {"cubin": b"x" * 1000}


def test_unwritable_folder_only_skips_the_save(tmp_path):
    blocker = tmp_path / "a file"
    blocker.write_text("")
    assert not kernel_cache.save_object(str(blocker / "kernels" / "k.nbk"), "key", {"x": 1})


def test_switch_and_folder_follow_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(kernel_cache.ENABLE_ENV, raising=False)
    assert kernel_cache.enabled()
    for off in ("0", "false", "off"):
        monkeypatch.setenv(kernel_cache.ENABLE_ENV, off)
        assert not kernel_cache.enabled()
    monkeypatch.setenv("NUMBA_ATTN_CACHE_DIR", str(tmp_path))
    assert kernel_cache.kernels_dir() == str(tmp_path / "kernels")


# -- kernel_jit without a GPU: lazy, and the cache plugged in or not --------------------------------------------------
_GPU_MODE_CHILD = """
import json, os
os.environ["NUMBA_ENABLE_CUDASIM"] = "0"   # no GPU needed: nothing below compiles
from numba import cuda
from numba_attn.runtime import kernel_cache
from numba_attn.runtime.device import kernel_jit
from numba_attn.forward import mma
from numba_attn.decode import combine

def build(scale, helper_offset):
    SCALE = scale
    @cuda.jit(device=True, forceinline=True)
    def helper(x):
        return x + helper_offset
    @kernel_jit(launch_bounds=(64,))
    def kernel(x):
        x[0] = helper(x[0]) * SCALE
    return kernel

a, b = build(2.0, 1), build(2.0, 1)
lazy = build(2.0, 1)
disp = lazy.dispatcher()   # a lazily typed kernel: creating its dispatcher compiles nothing
fixed = mma.flash_mma_kernel(mma.DEFAULT_CONFIG, 128, False, True)
print(json.dumps({
    "type": type(a).__name__, "compiled": a._dispatcher is not None,
    "same": kernel_cache.fingerprint(a.py_func) == kernel_cache.fingerprint(b.py_func),
    "scale": kernel_cache.fingerprint(a.py_func) != kernel_cache.fingerprint(build(3.0, 1).py_func),
    "helper": kernel_cache.fingerprint(a.py_func) != kernel_cache.fingerprint(build(2.0, 2).py_func),
    "cache": type(disp._cache).__name__, "specialized": fixed.specialized,
    "fixed_compiled": fixed._dispatcher is not None,
    "package": [kernel_cache.fingerprint(k.py_func)
                for k in (fixed, combine.combine_launch(128, "float32", "float32")[0])],
}))
"""


def _run_gpu_mode_child(extra_env=None):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    env.update(extra_env or {})
    res = subprocess.run([sys.executable, "-c", _GPU_MODE_CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_kernel_jit_is_lazy_and_keys_numba_device_functions():
    """Out of the simulator (no GPU needed): kernel_jit gives a CachedKernel that compiles nothing when made, the
    fingerprint follows closure values through real Numba device functions, and the package's kernels (closures
    over device functions and intrinsics) have fingerprints that agree between two processes."""
    first = _run_gpu_mode_child({"PYTHONHASHSEED": "1"})
    assert first["type"] == "CachedKernel" and not first["compiled"] and not first["fixed_compiled"]
    assert first["same"] and first["scale"] and first["helper"]
    assert first["cache"] == "DiskCache" and first["specialized"]
    assert all(first["package"])
    second = _run_gpu_mode_child({"PYTHONHASHSEED": "2", kernel_cache.ENABLE_ENV: "0"})
    assert second["package"] == first["package"]
    assert second["cache"] == "NullCache"  # switched off: Numba's dispatcher with no cache at all


# -- on a GPU: a second process loads what the first compiled ---------------------------------------------------------
_GPU_CHILD = """
import json, os, sys
import numpy as np
import numba_attn
from numba import cuda, float32, types
from numba_attn.runtime import kernel_cache, launch
from numba_attn.runtime.device import DeviceView, kernel_jit

SCALE = float(sys.argv[1])

def build(scale):
    S = float32(scale)
    @kernel_jit(launch_bounds=(64,), signature=types.void(types.Array(types.float32, 1, "A"),
                                                        types.Array(types.float32, 1, "A")))
    def fixed(x, out):
        i = cuda.grid(1)
        if i < x.shape[0]:
            out[i] = x[i] * S + 1
    @kernel_jit(launch_bounds=(64,))
    def lazy(x, out):
        i = cuda.grid(1)
        if i < x.shape[0]:
            out[i] = x[i] - S
    return fixed, lazy

fixed, lazy = build(SCALE)
x = cuda.to_device(np.arange(100, dtype=np.float32))
outs = [cuda.device_array(100, np.float32) for _ in range(3)]
launch.launch(fixed, 2, 64, 0, 0, DeviceView.of(x), DeviceView.of(outs[0]))
fixed[2, 64](x, outs[1])                    # Numba's own launch (NUMBA_ATTN_FAST_LAUNCH=0)
launch.launch(lazy, 2, 64, 0, 0, x, outs[2])
cuda.synchronize()
print(json.dumps({"stats": dict(kernel_cache.stats), "out": [o.copy_to_host().tolist() for o in outs],
                  "files": sorted(os.listdir(kernel_cache.kernels_dir())) if os.path.isdir(kernel_cache.kernels_dir())
                  else []}))
"""


def _run_gpu_child(cache_dir, scale, extra_env=None):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               NUMBA_ATTN_CACHE_DIR=str(cache_dir))
    env.pop(kernel_cache.ENABLE_ENV, None)
    env.update(extra_env or {})
    res = subprocess.run([sys.executable, "-c", _GPU_CHILD, str(scale)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.gpu
def test_second_process_loads_the_kernels_from_disk(tmp_path):
    first = _run_gpu_child(tmp_path, 2.0)
    assert first["stats"].get("hit", 0) == 0
    assert first["stats"]["miss"] == 2 and first["stats"]["stored"] == 2, first["stats"]
    assert len(first["files"]) == 2
    x = np.arange(100, dtype=np.float32)
    np.testing.assert_array_equal(first["out"][0], x * 2 + 1)
    np.testing.assert_array_equal(first["out"][1], x * 2 + 1)
    np.testing.assert_array_equal(first["out"][2], x - 2)
    second = _run_gpu_child(tmp_path, 2.0)
    assert second["stats"].get("miss", 0) == 0 and second["stats"].get("stored", 0) == 0, second["stats"]
    assert second["stats"]["hit"] == 2
    assert second["out"] == first["out"] and second["files"] == first["files"]


@pytest.mark.gpu
def test_changed_configuration_value_is_a_miss(tmp_path):
    _run_gpu_child(tmp_path, 2.0)
    other = _run_gpu_child(tmp_path, 3.0)  # nothing differs but the closure's constant
    assert other["stats"].get("hit", 0) == 0 and other["stats"]["miss"] == 2, other["stats"]
    x = np.arange(100, dtype=np.float32)
    np.testing.assert_array_equal(other["out"][0], x * 3 + 1)
    np.testing.assert_array_equal(other["out"][2], x - 3)
    assert len(other["files"]) == 4


@pytest.mark.gpu
def test_damaged_files_are_compiled_again(tmp_path):
    first = _run_gpu_child(tmp_path, 2.0)
    for name in first["files"]:
        path = tmp_path / "kernels" / name
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    again = _run_gpu_child(tmp_path, 2.0)
    assert again["stats"].get("hit", 0) == 0 and again["stats"]["unreadable"] == 2, again["stats"]
    assert again["stats"]["stored"] == 2 and again["out"] == first["out"]
    assert _run_gpu_child(tmp_path, 2.0)["stats"]["hit"] == 2  # rewritten whole


@pytest.mark.gpu
def test_switched_off_the_cache_writes_nothing(tmp_path):
    off = _run_gpu_child(tmp_path, 2.0, {kernel_cache.ENABLE_ENV: "0"})
    assert not off["stats"] and off["files"] == []
    x = np.arange(100, dtype=np.float32)
    np.testing.assert_array_equal(off["out"][0], x * 2 + 1)


@pytest.mark.gpu
def test_threads_asking_for_one_kernel_compile_it_once(tmp_path, monkeypatch):
    """Eight threads launch a kernel nobody compiled yet, at once: one compiles (and saves), the others wait for
    it, and every launch runs."""
    import threading

    from numba import cuda, float32, types

    from numba_attn.runtime import launch
    from numba_attn.runtime.device import DeviceView, kernel_jit

    monkeypatch.setenv("NUMBA_ATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(kernel_cache.ENABLE_ENV, raising=False)
    VALUE = float32(7.5)

    @kernel_jit(signature=types.void(types.Array(types.float32, 1, "A")))
    def fill(out):
        i = cuda.grid(1)
        if i < out.shape[0]:
            out[i] = VALUE

    before = dict(kernel_cache.stats)
    outs = [cuda.device_array(64, np.float32) for _ in range(8)]
    barrier = threading.Barrier(len(outs))
    errors = []

    def run(out):
        try:
            barrier.wait()
            launch.launch(fill, 1, 64, 0, 0, DeviceView.of(out))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(out,)) for out in outs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    cuda.synchronize()
    assert not errors, errors
    for out in outs:
        np.testing.assert_array_equal(out.copy_to_host(), np.full(64, 7.5, np.float32))
    grew = {event: kernel_cache.stats[event] - before.get(event, 0) for event in ("miss", "stored", "hit")}
    assert grew == {"miss": 1, "stored": 1, "hit": 0}, grew
    assert len(os.listdir(tmp_path / "kernels")) == 1


def test_prune_removes_least_recently_used_files_down_to_the_share(tmp_path):
    from numba_attn.runtime import cache_prune

    now = 1_000_000.0
    for i in range(10):  # file i used at now - 100 + i: file 0 longest ago
        path = tmp_path / f"k{i}.nbk"
        path.write_bytes(b"x" * 100)
        os.utime(path, (now - 100 + i, now - 100 + i))
    (tmp_path / ".tmp-old.nbk").write_bytes(b"x")
    os.utime(tmp_path / ".tmp-old.nbk", (now - 7200, now - 7200))
    (tmp_path / ".tmp-new.nbk").write_bytes(b"x")
    os.utime(tmp_path / ".tmp-new.nbk", (now - 10, now - 10))
    (tmp_path / "other.txt").write_bytes(b"x" * 5000)  # not a kernel file: never counted or removed
    assert cache_prune.prune(str(tmp_path), cap=1000, now=now) == 1  # within the cap: only the old temporary
    removed = cache_prune.prune(str(tmp_path), cap=500, now=now)  # 1000 bytes > 500: down to 400
    assert removed == 6
    assert sorted(p.name for p in tmp_path.glob("k*.nbk")) == [f"k{i}.nbk" for i in range(6, 10)]
    assert (tmp_path / ".tmp-new.nbk").exists() and (tmp_path / "other.txt").exists()
    assert cache_prune.prune(str(tmp_path), cap=0, now=now) == 0  # 0: off


def test_prune_cap_from_the_environment(monkeypatch):
    from numba_attn.runtime import cache_prune

    monkeypatch.setenv(cache_prune.MAX_MB_ENV, "2")
    assert cache_prune.max_bytes() == 2 << 20
    monkeypatch.setenv(cache_prune.MAX_MB_ENV, "0")
    assert cache_prune.max_bytes() == 0
    monkeypatch.delenv(cache_prune.MAX_MB_ENV)
    assert cache_prune.max_bytes() == cache_prune.DEFAULT_MAX_MB << 20
    for bad in ("lots", "-1"):
        monkeypatch.setenv(cache_prune.MAX_MB_ENV, bad)
        with pytest.raises(ValueError, match=f"^{cache_prune.MAX_MB_ENV}"):
            cache_prune.max_bytes()
