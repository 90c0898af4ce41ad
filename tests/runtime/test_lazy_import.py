"""``import numba_attn`` loads the forward family only; the others load on first use (``runtime.lazy``)."""
import subprocess
import sys

LAZY = ("numba_attn.backward.dispatch", "numba_attn.decode.dispatch", "numba_attn.decode.cached",
        "numba_attn.linear.api", "numba_attn.linear.dispatch", "numba_attn.forward.varlen",
        "numba_attn.backward.varlen", "numba_attn.forward.fp8_call")


def test_import_leaves_other_families_unloaded():
    code = ("import sys, numba_attn; print(','.join(m for m in %r if m in sys.modules)); "
            "from numba_attn import causal_dot_product, LINEAR_BACKENDS, flash_backward; "
            "import numba_attn.api as api; assert api.linear_attention is numba_attn.linear_attention; "
            "assert 'mma' in api._backward.BACKENDS; assert LINEAR_BACKENDS == ('chunked', 'recurrent'); "
            "print('ok')" % (LAZY,))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[0] == "", f"imported eagerly: {out[0]}"
    assert out[1] == "ok"


def test_unknown_name_is_an_attribute_error():
    import numba_attn
    import pytest

    with pytest.raises(AttributeError, match="no_such_thing"):
        numba_attn.no_such_thing
