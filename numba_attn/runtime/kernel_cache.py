"""Keep compiled kernels on disk, keyed by what they are compiled from, so that a new process loads them.

Numba's own cache (``cache=True``) never hits for this package's kernels in a new process: its key hashes the pickled
closure of the kernel, and the device functions in it pickle with a per-process uuid. Here a kernel's key is a
fingerprint of its Python function, the same in every process: bytecode, constants, closure values and the globals
its code names, recursively through the device functions and intrinsics it calls, each value keyed by what it is
(numbers, strings and tuples by value, frozen dataclasses by their fields, dtypes and Numba types by name, modules by
name, functions by their own fingerprint). A value of any other kind leaves the kernel uncached: it compiles as
before. The key adds a hash of every ``.py`` file of the package, the versions of Numba, numba-cuda, llvmlite and
NumPy, the NVVM, nvJitLink and driver versions, Numba's code-generation settings, the compute capability, the
compile options and the argument types.

One file per key under ``$NUMBA_ATTN_CACHE_DIR/kernels/`` (default ``~/.cache/numba_attn/kernels``; delete the
folder to clear it), written atomically, checksummed: a damaged or unreadable file is a miss (compiled and written
again), an unwritable folder only costs the saving. ``NUMBA_ATTN_KERNEL_CACHE=0`` turns the cache off;
``NUMBA_ATTN_KERNEL_CACHE_LOG=1`` reports each hit, miss, save and uncached kernel on stderr. The folder is kept
under ``NUMBA_ATTN_KERNEL_CACHE_MAX_MB`` (least recently used files go first, ``cache_prune``).

``CachedKernel`` is what ``runtime.device.kernel_jit`` gives on a GPU: it stands in for Numba's dispatcher, compiles
nothing when made and plugs this cache into the dispatcher it creates on first use.
"""
from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import hashlib
import os
import pickle
import re
import sys
import tempfile
import threading
import types as _pytypes

import numpy as np

from . import cache_prune
from .autotune import cache_dir

ENABLE_ENV = "NUMBA_ATTN_KERNEL_CACHE"
LOG_ENV = "NUMBA_ATTN_KERNEL_CACHE_LOG"
#: Bumped whenever the file layout or what the key covers changes: old files then simply never match.
FORMAT = 1
_MAGIC = b"numba_attn kernel %d\n" % FORMAT

#: Modules whose code is fixed by an installed version that the key holds: their objects are keyed by name.
_LIBRARIES = frozenset({"numba", "llvmlite", "numpy", "math", "cmath", "operator", "builtins"})
_PACKAGE = __name__.split(".")[0]
#: Numba settings that change the code it generates (the rest only change logging, warnings or memory management).
_CODEGEN_CONFIG = ("CUDA_ENABLE_NRT", "FORCE_CUDA_CC", "CUDA_DEBUGINFO_DEFAULT", "OPT", "BOUNDSCHECK",
                   "CUDA_DEBUG_POLY", "CUDA_DEBUG_POLY_USE_TYPED_CONST", "EXTEND_VARIABLE_LIFETIMES",
                   "CUDA_DEFAULT_PTX_CC")

#: What happened since the process started: "hit", "miss", "stored", "uncached", "unreadable", "unsaved".
stats: collections.Counter = collections.Counter()


def enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def kernels_dir() -> str:
    return os.path.join(cache_dir(), "kernels")


def _log(event: str, what: str) -> None:
    stats[event] += 1
    if os.environ.get(LOG_ENV, "0").strip().lower() not in ("0", "", "false", "no", "off"):
        print(f"numba_attn kernel cache: {event} {what}", file=sys.stderr, flush=True)


# -- the fingerprint ---------------------------------------------------------------------------------------------------
class Unkeyable(Exception):
    """A value whose effect on the compiled code cannot be keyed safely."""


def _top(module) -> str:
    return (module or "").split(".")[0]


def _names(co) -> tuple:
    """Every name the code object and the code nested in it use (globals and attributes), in order of appearance."""
    names = dict.fromkeys(co.co_names)
    for c in co.co_consts:
        if isinstance(c, _pytypes.CodeType):
            names.update(dict.fromkeys(_names(c)))
    return tuple(names)


def _digest(parts) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def _by_name(v):
    """(module, qualname) when ``v`` is what that name gives, else None."""
    module = getattr(v, "__module__", None)
    qualname = getattr(v, "__qualname__", None) or getattr(v, "__name__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or "<" in qualname:
        return None
    obj = sys.modules.get(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return (module, qualname) if obj is v else None


class _Fingerprinter:
    """One walk over a kernel and everything it reaches; functions reached twice are hashed once, and a function
    reached again while it is being hashed (recursion) is keyed by its name."""

    def __init__(self):
        self._done: dict = {}
        self._active: set = set()
        self._held: list = []  # keeps every memoised object alive, so that no id is reused during the walk

    def function(self, fn) -> str:
        key = id(fn)
        if key in self._done:
            return self._done[key]
        if key in self._active:
            return f"cycle {fn.__module__}.{fn.__qualname__}"
        self._active.add(key)
        try:
            closure = ()
            if fn.__closure__:
                cells = []
                for name, cell in zip(fn.__code__.co_freevars, fn.__closure__):
                    try:
                        contents = cell.cell_contents
                    except ValueError:  # an empty cell
                        cells.append((name, "empty"))
                        continue
                    cells.append((name, self.value(contents, _names(fn.__code__))))
                closure = tuple(cells)
            parts = ("function", fn.__module__, fn.__qualname__, self.code(fn.__code__, fn.__globals__),
                     self.value(fn.__defaults__), self.value(tuple(sorted((fn.__kwdefaults__ or {}).items()))),
                     closure)
        finally:
            self._active.discard(key)
        digest = _digest(parts)
        self._done[key] = digest
        self._held.append(fn)
        return digest

    def code(self, co, globals_: dict) -> tuple:
        consts = tuple(("code", self.code(c, globals_)) if isinstance(c, _pytypes.CodeType) else self.value(c)
                       for c in co.co_consts)
        names = []
        builtins = globals_.get("__builtins__", {})
        if isinstance(builtins, _pytypes.ModuleType):
            builtins = vars(builtins)
        for name in co.co_names:
            if name in globals_:
                names.append((name, self.value(globals_[name], co.co_names)))
            elif name in builtins:
                names.append((name, "builtin"))
            else:
                names.append((name, "absent"))  # an attribute name, or a global that does not exist (yet)
        # line numbers too: with lineinfo or debug on they are in the PTX (for the package's own kernels any edit
        # changes the source hash anyway)
        return (co.co_name, co.co_argcount, co.co_posonlyargcount, co.co_kwonlyargcount, co.co_flags,
                co.co_varnames, co.co_freevars, co.co_cellvars, co.co_code, co.co_firstlineno,
                getattr(co, "co_linetable", None), consts, tuple(names))

    def value(self, v, names: tuple = ()):
        """The key of one value; ``names``: the names the code that reaches it uses (the attributes of a module that
        it may read)."""
        t = type(v)
        if v is None or v is Ellipsis or t in (bool, int, float, complex, str):
            return (t.__name__, repr(v))
        if t is bytes:
            return ("bytes", hashlib.sha256(v).hexdigest())
        if t is tuple:
            return ("tuple",) + tuple(self.value(x, names) for x in v)
        if t is frozenset:
            return ("frozenset",) + tuple(sorted((self.value(x, names) for x in v), key=repr))
        if isinstance(v, np.generic):
            return ("numpy scalar", v.dtype.str, v.tobytes().hex())
        if isinstance(v, np.dtype):
            return ("dtype", str(v), v.str)
        if isinstance(v, np.ndarray):  # Numba freezes a global array into the code
            return ("ndarray", v.dtype.str, v.shape, hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest())
        if isinstance(v, _pytypes.ModuleType):
            return self.module(v, names)
        if isinstance(v, _pytypes.FunctionType):
            named = _by_name(v)
            if named is not None and _top(named[0]) in _LIBRARIES:
                return ("by name",) + named  # a library's function: its version is in the key
            return ("function", self.function(v))
        if isinstance(v, enum.Enum):
            return ("enum", t.__module__, t.__qualname__, v.name, self.value(v.value))
        if isinstance(v, tuple) and hasattr(v, "_fields"):  # a named tuple: Numba types it with its class
            return ("namedtuple", t.__module__, t.__qualname__) + tuple(self.value(x, names) for x in v)
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            if not t.__dataclass_params__.frozen:
                raise Unkeyable(f"a mutable dataclass instance ({t.__qualname__})")
            return ("dataclass", t.__module__, t.__qualname__) + tuple(
                (f.name, self.value(getattr(v, f.name), names)) for f in dataclasses.fields(v))
        kind = _numba_kind(v)
        if kind == "type":
            return ("numba type", t.__qualname__, str(v))
        if kind == "signature":
            return ("numba signature", str(v))
        if kind == "device function":
            return ("device function", self.function(v.py_func), self.options(v.targetoptions),
                    () if getattr(v, "_can_compile", True) else tuple(str(s) for s in v.overloads))
        if kind == "intrinsic":
            named = _by_name(v)
            if named is not None and _top(named[0]) in _LIBRARIES:
                return ("library intrinsic",) + named
            return ("intrinsic", v._name, getattr(v, "_prefer_literal", None), self.function(v._defn))
        if t.__module__.startswith("llvmlite.ir"):
            return ("llvm", t.__qualname__, str(v))  # IR types and constants the intrinsics' code generation uses
        named = _by_name(v)
        if named is not None:
            if isinstance(v, type) and issubclass(v, enum.Enum):
                return ("enum class",) + named + tuple((m.name, self.value(m.value)) for m in v)
            if _top(named[0]) in _LIBRARIES or (_top(named[0]) == _PACKAGE and isinstance(v, type)):
                # a library object (np.float32, math.log2, cuda stubs), or a class of the package (source hashed)
                return ("by name",) + named
        raise Unkeyable(f"{t.__module__}.{t.__qualname__} value {v!r:.80}")

    def module(self, mod, names: tuple):
        if _top(mod.__name__) in _LIBRARIES:
            # by the library's name alone: ``from numba import types`` gives ``numba.types`` or ``numba.core.types``
            # depending on what was imported before, one meaning under two names (the versions are in the key)
            return ("module", _top(mod.__name__))
        key = (id(mod), names)
        if key in self._done:
            return self._done[key]
        if key in self._active:
            return ("module", mod.__name__, "cycle")
        self._active.add(key)
        try:
            # a module of the package or of the caller: the attributes the code may read of it count by value
            attrs = tuple((name, self.value(getattr(mod, name), names)) for name in names if hasattr(mod, name))
        finally:
            self._active.discard(key)
        result = ("module", mod.__name__, attrs)
        self._done[key] = result
        self._held.append(mod)
        return result

    def options(self, options: dict) -> tuple:
        items = []
        for name, value in sorted(options.items()):
            if name in ("link", "extensions"):
                if value:
                    raise Unkeyable(f"option {name}={value!r}")  # linked files and extensions: contents unknown
                value = ()
            elif isinstance(value, list):
                value = tuple(value)
            items.append((name, self.value(value)))
        return tuple(items)


def _numba_kind(v):
    """What ``v`` is to Numba, without importing the CUDA target (absent under the simulator)."""
    t = type(v)
    module = t.__module__ or ""
    if not module.startswith("numba"):
        return None
    from numba.core import types as _nbtypes
    from numba.core.typing.templates import Signature

    if isinstance(v, _nbtypes.Type):
        return "type"
    if isinstance(v, Signature):
        return "signature"
    if t.__name__ == "CUDADispatcher" and hasattr(v, "py_func"):
        if not v.targetoptions.get("device"):
            raise Unkeyable(f"a kernel ({v.py_func.__qualname__}) reached from a kernel")
        return "device function"
    if t.__name__ == "_Intrinsic" and hasattr(v, "_defn"):
        return "intrinsic"
    return None


def explain(fn) -> str:
    """Why ``fn`` has no fingerprint ('' when it has one)."""
    try:
        _Fingerprinter().function(fn)
        return ""
    except Unkeyable as exc:
        return str(exc)
    except RecursionError:
        return "nested too deeply"
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__} while keying: {exc}"


def fingerprint(fn) -> str | None:
    """A hash of everything in ``fn`` that decides what Numba compiles, equal across processes; None when some value
    it reaches cannot be keyed safely, or keying fails in any other way (the kernel is then not cached)."""
    try:
        return _Fingerprinter().function(fn)
    except Exception:  # noqa: BLE001  (Unkeyable, RecursionError, an attribute that raises: never guess)
        return None


def options_key(options: dict) -> tuple | None:
    """The key of a dispatcher's compile options (None: options whose effect cannot be keyed, such as linked
    files)."""
    try:
        return _Fingerprinter().options(options)
    except Exception:  # noqa: BLE001
        return None


def source_hash(root: str) -> str:
    """A hash of the relative path and contents of every ``.py`` file under ``root`` (``__pycache__`` skipped)."""
    h = hashlib.sha256()
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                h.update(os.path.relpath(path, root).replace(os.sep, "/").encode() + b"\0")
                with open(path, "rb") as f:
                    h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def package_hash() -> str:
    """``source_hash`` of the package, read once per process: any edit of its source is a miss for every kernel.
    OSError where the source files cannot be found (a package run from a zip)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.isfile(os.path.join(root, "__init__.py")):
        raise OSError(f"no source files under {root}")
    return source_hash(root)


@functools.lru_cache(maxsize=None)
def toolchain() -> tuple:
    """What besides the source decides the binary: versions of the compilers and libraries, Numba's code-generation
    settings (read once per process, on the first kernel compiled or loaded)."""
    import llvmlite
    import numba
    import numba_cuda
    from numba.cuda.core import config

    parts = [("python", sys.version_info[:3]), ("numba", numba.__version__), ("numba-cuda", numba_cuda.__version__),
             ("llvmlite", llvmlite.__version__), ("numpy", np.__version__)]
    parts += [(name, repr(getattr(config, name, None))) for name in _CODEGEN_CONFIG]
    try:
        from numba.cuda.cudadrv import nvvm

        parts.append(("nvvm", tuple(nvvm.NVVM().get_version()), tuple(nvvm.NVVM().get_ir_version())))
    except Exception as exc:  # noqa: BLE001  (no NVVM: nothing compiles anyway; the key says so)
        parts.append(("nvvm", type(exc).__name__))
    try:
        from numba.cuda.cudadrv.driver import _have_nvjitlink

        if _have_nvjitlink():
            from cuda.bindings import nvjitlink

            parts.append(("nvjitlink", tuple(nvjitlink.version())))
    except Exception:  # noqa: BLE001
        parts.append(("nvjitlink", None))
    try:
        from numba.cuda.cudadrv.driver import driver

        parts.append(("driver", tuple(driver.get_version())))
    except Exception:  # noqa: BLE001
        parts.append(("driver", None))
    return tuple(parts)


# -- the files ---------------------------------------------------------------------------------------------------------
def write_atomically(path: str, body: bytes) -> bool:
    """Write ``_MAGIC``, the body's sha256 and ``body`` to ``path`` through a temporary file and ``os.replace``: a
    reader sees the old file or the new one, and two writers of one key leave one whole file. False where the folder
    cannot be written."""
    folder = os.path.dirname(path)
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".nbk")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_MAGIC + hashlib.sha256(body).digest() + body)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        return True
    except OSError:
        return False


def read_checked(path: str) -> bytes | None:
    """The body ``write_atomically`` wrote to ``path``; None for a missing, unreadable or damaged file."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    head = len(_MAGIC)
    body = data[head + 32:]
    if not data.startswith(_MAGIC) or len(data) < head + 32 or hashlib.sha256(body).digest() != data[head:head + 32]:
        return None
    return body


def save_object(path: str, key: str, obj) -> bool:
    """Pickle ``obj`` with Numba's pickler (as Numba's own cache does) under ``key`` to ``path``."""
    from numba.cuda.serialize import dumps

    return write_atomically(path, dumps({"key": key, "object": obj}))


def load_object(path: str, key: str):
    """What ``save_object`` stored under ``key``; None when the file is missing, damaged, unreadable or holds
    another key."""
    body = read_checked(path)
    if body is None:
        return None
    try:
        payload = pickle.loads(body)
    except Exception:  # noqa: BLE001  (a file of another version of a library: a miss)
        return None
    if not isinstance(payload, dict) or payload.get("key") != key:
        return None
    return payload.get("object")


# -- the cache Numba's dispatcher consults ----------------------------------------------------------------------------
class DiskCache:
    """Numba's cache interface (``load_overload``, ``save_overload``) over this module's files, for one dispatcher.
    Numba calls both inside ``CUDADispatcher.compile``, under its global compiler lock."""

    def __init__(self, dispatcher):
        self._py_func = dispatcher.py_func
        self._options = dict(dispatcher.targetoptions)
        self._told = False  # an uncached kernel is reported once
        self.cache_path = kernels_dir()

    def _name(self) -> str:
        fn = self._py_func
        return f"{fn.__module__}.{fn.__qualname__}"

    def _path_and_key(self, sig):
        """The file and the full key for these argument types; (None, None) for a kernel that is not cached. The
        fingerprint is taken again on every load and save (some milliseconds): the closure's values then are what
        Numba compiles."""
        from numba.cuda import get_current_device
        from numba.cuda.core import sigutils

        fp = fingerprint(self._py_func)
        options = options_key(self._options)
        if fp is None or options is None:
            if not self._told:
                self._told = True
                _log("uncached", f"{self._name()}: {explain(self._py_func) if fp is None else 'its options'}")
            return None, None
        argtypes, _ = sigutils.normalize_signature(sig)
        cc = tuple(get_current_device().compute_capability)
        try:
            source = package_hash()
        except OSError:  # the package's source cannot be read (a zip): nothing would notice an edit
            if not self._told:
                self._told = True
                _log("uncached", f"{self._name()}: the package's source cannot be read")
            return None, None
        key = repr((FORMAT, fp, options, source, toolchain(), cc,
                    tuple((type(a).__qualname__, str(a)) for a in argtypes)))
        label = re.sub(r"[^A-Za-z0-9_.]+", "_", self._name().replace("<locals>.", ""))[-80:]
        name = f"{label}-{hashlib.sha256(key.encode()).hexdigest()[:40]}.nbk"
        return os.path.join(self.cache_path, name), key

    def load_overload(self, sig, target_context):
        path, key = self._path_and_key(sig)
        if path is None:
            return None
        states = load_object(path, key)
        if states is None:
            _log("unreadable" if os.path.exists(path) else "miss", path)
            return None
        try:
            from numba.cuda.dispatcher import _Kernel

            kernel = _Kernel._rebuild(**states)
            kernel._codelibrary._codegen = target_context.codegen()  # Numba's own cache leaves None; set it anyway
        except Exception:  # noqa: BLE001  (states another version wrote: compile instead)
            _log("unreadable", path)
            return None
        _log("hit", path)
        cache_prune.touch(path)
        return kernel

    def save_overload(self, sig, kernel):
        if getattr(kernel, "launch_config_sensitive", False):
            return  # its code depends on the launch configuration, which the key does not hold
        path, key = self._path_and_key(sig)
        if path is None:
            return
        try:
            kernel._codelibrary.get_cubin()  # the current device's binary (compiled by bind() already) is saved too
            saved = save_object(path, key, kernel._reduce_states())
        except Exception:  # noqa: BLE001  (device arrays captured, linked files: Numba refuses to pickle them)
            saved = False
        _log("stored" if saved else "unsaved", path)
        if saved:
            cache_prune.prune_once(self.cache_path)

    def flush(self):
        pass


# -- the kernel object -------------------------------------------------------------------------------------------------
class CachedKernel:
    """A kernel as ``kernel_jit`` gives it on a GPU, used as Numba's dispatcher is: ``kernel[grid, block, stream,
    shared](*args)``, ``overloads``, ``specialized``, ``compile(argtypes)``, ``typeof_pyval(value)``, and any other
    attribute of the dispatcher. Nothing is compiled when it is made: the Numba dispatcher is created on first use,
    with this module's cache plugged in, and a kernel with a fixed ``signature`` is then compiled (or loaded) for it.
    Thread-safe: one thread creates the dispatcher and compiles, the others wait."""

    def __init__(self, py_func, signature, options: dict):
        self.py_func = py_func
        self.signature = signature
        self.options = dict(options)
        self._dispatcher = None
        self._lock = threading.Lock()
        functools.update_wrapper(self, py_func, updated=())

    @property
    def specialized(self) -> bool:
        """True for a kernel with a fixed signature (as for a Numba dispatcher made with one)."""
        return self.signature is not None

    def dispatcher(self):
        """The Numba dispatcher, created (and, with a fixed signature, compiled) on the first call."""
        disp = self._dispatcher
        if disp is not None:
            return disp
        with self._lock:
            if self._dispatcher is None:
                from numba import cuda
                from numba.cuda import types
                from numba.cuda.core import sigutils

                disp = cuda.jit(**self.options)(self.py_func)
                if enabled():
                    disp._cache = DiskCache(disp)
                if self.signature is not None:  # as cuda.jit(signature) does, on first use instead of at once
                    argtypes, restype = sigutils.normalize_signature(self.signature)
                    if restype is not None and restype != types.void:
                        raise TypeError("CUDA kernel must have void return type.")
                    disp.compile(argtypes)
                    disp._specialized = True
                    disp.disable_compile()
                self._dispatcher = disp
            return self._dispatcher

    @property
    def overloads(self) -> dict:
        return self.dispatcher().overloads

    def compile(self, sig):
        return self.dispatcher().compile(sig)

    def typeof_pyval(self, val):
        return self.dispatcher().typeof_pyval(val)

    def __getitem__(self, launch_config):
        return self.dispatcher()[launch_config]

    def __call__(self, *args):
        return self.dispatcher()(*args)  # (Numba's answer: a kernel needs a launch configuration)

    def __getattr__(self, name):
        if name.startswith("__") or name in ("_dispatcher", "_lock"):
            raise AttributeError(name)
        return getattr(self.dispatcher(), name)

    def __repr__(self) -> str:
        state = "not compiled yet" if self._dispatcher is None else f"{len(self._dispatcher.overloads)} overloads"
        return f"<CachedKernel {self.py_func.__qualname__} ({state})>"
