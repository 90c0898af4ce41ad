"""Probe (wrong results, timing only): the WS window kernel with tile 0's softmax unmasked, per-phase times."""
import sys
sys.path.insert(0, "scripts")
import ws_timeline
real = ws_timeline.rewritten_source
def patched(src):
    old = "online_softmax(s, alpha, m_run, l_run, partial(n_first, m_c, key_end, causal, diag_offset), n_first,"
    assert src.count(old) == 1
    return real(src.replace(old, "online_softmax(s, alpha, m_run, l_run, False, n_first,"))
ws_timeline.rewritten_source = patched
ws_timeline.main(["--windows", "4096", "--stores", "tma"])
