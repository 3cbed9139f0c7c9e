"""tools/trace_summary.py on a synthetic trace log whose per-tile numbers are known (CPU)."""
import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("trace_summary", ROOT / "tools" / "trace_summary.py")
trace_summary = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(trace_summary)


def _line(t, e):
    return (f"TRACE block 0 item 0 it {t:2d} | {e[0]:6d} {e[1]:6d} {e[2]:6d} {e[3]:6d} | {e[4]:6d} {e[5]:6d} {e[6]:6d} "
            f"{e[7]:6d} | {e[8]:6d} {e[9]:6d} | {e[10]:6d} {e[11]:6d} {e[12]:6d} | {e[13]:6d} {e[14]:6d} {e[15]:6d}")


def _log(period=1000, s=700, value=900):
    """A steady pipeline: tile t's P is published at 1000 t + 500; the value side reaches tile t at 1000 t + 450 on
    odd tiles (so it waits 50 for P) and at 1000 t + 600 on even ones, and works `value` from the later of the two."""
    lines = ["=== repeat 0 P=1 N=9", "TRACE block 0 item 0 tiles 12 total 1", "=== repeat 1 P=1 N=9"]
    for t in range(12):
        e = [0] * 16
        e[3] = period * t + 500 + 10_000          # P published
        e[2] = e[3] - 1500                        # m wait done, before the P buffer is free (e7 of tile t - 2)
        e[8] = e[3] - 2000                        # S issued
        e[1] = e[8] + s                           # S done
        e[4] = e[3] - 50 if t % 2 else e[3] + 100   # the value side reaches the tile
        e[7] = max(e[4], e[3]) + value            # and releases it
        lines.append(_line(t, e))
    return "\n".join(lines) + "\n"


def test_summary_of_a_known_pipeline():
    tiles = trace_summary.tiles_of(_log())
    assert sorted(tiles) == list(range(12)) and all(len(v) == 16 for v in tiles.values())
    r = trace_summary.summarise(tiles, first=4)
    assert r["tiles"] == 8
    assert r["period"] == 1000
    assert r["value_work"] == 900
    assert r["value_waits"] == 4 and r["value_wait"] == 50   # the odd tiles 5, 7, 9, 11
    assert r["s"] == 700
    # P's buffer is freed at e7(t - 2) = e3(t) - 2000 + 900 (+ 100 where the value side reached tile t - 2 late, the
    # even tiles): 1,100 before P for odd t, 1,000 for even t; the median of four of each
    assert r["p_after_buffer"] == 1050


def test_the_last_repeat_is_read_by_default_and_a_repeat_can_be_named():
    log = _log() + "=== repeat 2 P=1 N=9\n"   # a last repeat with no tile lines
    try:
        trace_summary.summarise(trace_summary.tiles_of(log))
    except ValueError as err:
        assert "too few tiles" in str(err)
    else:
        raise AssertionError("an empty last call was summarised")
    assert trace_summary.summarise(trace_summary.tiles_of(log, repeat=1))["period"] == 1000
