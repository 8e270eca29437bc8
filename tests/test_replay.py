"""The replay backend: table parsing and checks, search space, repeats, and the real-table conversion."""
from __future__ import annotations

import csv
from pathlib import Path

import pytest

from kareus.hardware.base import HardwareBackend
from kareus.hardware.replay import ReplayConfig, TableError, load_table
from kareus.registry import HARDWARE
from kareus.types import SEQUENTIAL, Candidate

ROOT = Path(__file__).resolve().parents[1]
REAL = ROOT.parent / "shared" / "data" / "a100_attention_tp2"

HEADER = "partition,slot,sms,freq_mhz,time_s,energy_j,repeat\n"
GOOD = HEADER + (
    "p,sequential,4,1410,0.004,1.0,0\n"
    "p,sequential,4,1410,0.005,1.1,1\n"
    "p,norm_0,4,1410,0.003,0.9,0\n"
    "p,norm_0,8,1410,0.0028,0.95,0\n"
    "p,attn_0,8,1200,0.0031,0.8,0\n"
    "p.join_norm_0,norm_0,8,1410,0.0033,0.97,0\n"
)


def write(tmp_path, text, name="t.csv"):
    path = tmp_path / name
    path.write_text(text)
    return path


def build(path, **kw):
    import kareus.hardware  # noqa: F401

    return HARDWARE.build("replay", config={"table": str(path), **kw})


def test_space_is_exactly_the_table_and_repeats_come_in_turn(tmp_path):
    b = build(write(tmp_path, GOOD))
    assert isinstance(b, HardwareBackend)
    parts = {p.key: p for p in b.partitions()}
    p = parts["p"]
    assert p.slot_labels == (SEQUENTIAL, "norm_0", "attn_0") and p.join is None
    assert [s.kind for s in p.slots] == ["memory", "attention"]
    assert parts["p.join_norm_0"].join == 0
    assert set(b.space(p)) == {Candidate("p", SEQUENTIAL, 4, 1410), Candidate("p", "norm_0", 4, 1410),
                               Candidate("p", "norm_0", 8, 1410), Candidate("p", "attn_0", 8, 1200)}
    c = Candidate("p", SEQUENTIAL, 4, 1410)
    got = [b.measure(p, c, 5.0) for _ in range(3)]
    assert [r.time_s for r in got] == [0.004, 0.005, 0.004]
    assert [r.energy_j for r in got] == [1.0, 1.1, 1.0]
    assert b.now() == pytest.approx(15.0)
    assert b.run_once(p, c) in (0.004, 0.005)


def test_clock_and_unknown_configurations(tmp_path):
    b = build(write(tmp_path, GOOD), static_power_w=70.0)
    p = {x.key: x for x in b.partitions()}["p"]
    assert b.gpu.static_power_w == 70.0
    with pytest.raises(ValueError, match="clock"):
        b.measure(p, Candidate("p", "attn_0", 8, 1200), 1.0)
    b.set_clock(1200)
    assert b.measure(p, Candidate("p", "attn_0", 8, 1200), 1.0).ok
    missing = b.measure(p, Candidate("p", "attn_0", 9, 1200), 1.0)
    assert not missing.ok and "not in the replay table" in missing.error
    assert not b.measure_ops(p.compute, 1.0).ok


@pytest.mark.parametrize("text, line, what", [
    ("partition,slot,sms,freq_mhz,time_s\np,sequential,4,1410,0.1\n", 1, "missing column"),
    (HEADER + "p,sequential,4,1410,0.004,1.0,0\np,norm_0,four,1410,0.003,0.9,0\n", 3, "non-numeric"),
    (HEADER + "p,sequential,4,1410,0.004,1.0,0\np,norm_0,4,1410,0.003,0.9,0\np,norm_0,8,1410,-0.003,0.9,0\n",
     4, "negative"),
    # the profiler refuses a zero energy reading: accepted here, the setting only ever failed
    (HEADER + "p,sequential,4,1410,0.004,1.0,0\np,norm_0,4,1410,0.003,0.0,0\n", 3, "negative or zero"),
    (HEADER + "p,sequential,4,1410,0.004,1.0,0\np,sequential,4,1410,0.0041,1.0,0\n", 3, "duplicate"),
    # a key naming a folder crashed the run's output step after every search had finished
    (HEADER + "p,sequential,4,1410,0.004,1.0,0\nfwd/attn,sequential,4,1410,0.004,1.0,0\n", 3,
     "partition 'fwd/attn': a key names the run's files"),
    (HEADER + "..,sequential,4,1410,0.004,1.0,0\n", 2, "partition '..': a key names the run's files"),
])
def test_malformed_tables_are_rejected_with_the_line(tmp_path, text, line, what):
    path = write(tmp_path, text)
    with pytest.raises(TableError) as err:
        load_table(path)
    msg = str(err.value)
    assert isinstance(err.value, ValueError) and "\n" not in msg
    assert f"{path}:{line}:" in msg and what in msg


def test_a_table_saved_with_a_byte_order_mark_loads(tmp_path):
    """Spreadsheets write 'CSV UTF-8' with one; it hid the first column: 'missing column(s) partition'."""
    (tmp_path / "t.csv").write_bytes(b"\xef\xbb\xbf" + GOOD.encode())
    assert load_table(tmp_path / "t.csv") == load_table(write(tmp_path, GOOD, "plain.csv"))


def test_kareus_own_partition_keys_load(tmp_path):
    """Megatron's reference partitions are named megatron:<key>: a table recorded from a run holds them."""
    table = load_table(write(tmp_path, HEADER + "megatron:fwd_attn,sequential,16,1410,0.004,1.0,0\n"
                                                 "fwd_attn.join_norm_0,norm_0,4,1410,0.004,1.0,0\n"))
    assert {k[0] for k in table} == {"megatron:fwd_attn", "fwd_attn.join_norm_0"}


def test_rows_without_repeat_column_are_repeats_in_order(tmp_path):
    text = "partition,slot,sms,freq_mhz,time_s,energy_j\np,norm_0,2,1410,0.01,2\np,norm_0,2,1410,0.02,3\n"
    assert load_table(write(tmp_path, text))[("p", "norm_0", 2, 1410)] == [(0.01, 2.0), (0.02, 3.0)]


def test_a_table_that_is_not_text_is_a_table_error_naming_it(tmp_path):
    """It escaped as the codec's error, which validation printed as 'hardware.cannot be checked: ...'."""
    (tmp_path / "t.csv").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(TableError, match=r"t.csv: not UTF-8 text \(byte 0xff at 0\)"):
        load_table(tmp_path / "t.csv")


def test_missing_table_is_a_clear_error(tmp_path):
    with pytest.raises(TableError, match="hardware.table"):
        build("")
    assert ReplayConfig().gpu_spec().sms == 108  # validation needs no table


@pytest.mark.skipif(not REAL.is_dir(), reason="real tables not present")
def test_convert_the_real_a100_tables(tmp_path):
    from kareus.hardware.tables import PARTITION_KEY, convert_a100_attention

    out = convert_a100_attention(REAL, tmp_path / "a100.csv")
    b = build(out)
    parts = {p.key: p for p in b.partitions()}
    main = parts[PARTITION_KEY]
    assert main.slot_labels == (SEQUENTIAL, "norm_0", "linear_0", "rope_0", "attn_0", "linear_1")
    assert parts[f"{PARTITION_KEY}.join_linear_0"].join == 1  # (0,2),(2,2): joined after linear_qkv
    # default clock: 5 windows + sequential joined at the end, 20 SM counts; 1200 MHz: (6,6) and sequential
    space = b.space(main)
    assert len([c for c in space if c.freq_mhz == 1410]) == 6 * 20
    assert {c.freq_mhz for c in space} == {1410, 1200}
    with open(REAL / "clock_default.csv") as fh:
        first = next(r for r in csv.DictReader(fh) if r["comm_block_size"] == "1024")
    r = b.measure(main, Candidate(PARTITION_KEY, SEQUENTIAL, int(first["comm_sm_number"]), 1410), 10.0)
    assert r.energy_j == pytest.approx(float(first["0:total energy (J)"]) / 2, rel=1e-6)  # per GPU
    assert r.time_s == pytest.approx(float(first["0:time (s)"]), rel=1e-6)


SOURCE_HEADER = "overlap_start,overlap_end,comm_sm_number,comm_block_size,0:time (s),0:total energy (J)\n"


@pytest.mark.parametrize("files, says", [
    ({}, "cannot read"),  # an empty folder
    ({"clock_default.csv": "a,b\n1,2\n", "clock_1200mhz.csv": "a,b\n1,2\n"}, "no column 'comm_block_size'"),
    ({"clock_default.csv": "overlap_start,overlap_end,comm_sm_number,comm_block_size,0:time (s),0:total energy (J)\n"
                           "-1,-1,x,1024,0.001,2.0\n"}, "line 2: a value that is not a number"),
    # both copies became repeats 0.. of one setting: a table its own loader refused
    ({"clock_default.csv": "overlap_start,overlap_end,comm_sm_number,comm_block_size,0:time (s),0:total energy (J)\n"
                           "-1,-1,4,1024,0.001,2.0\n-1,-1,4,1024,0.001,2.0\n"},
     "line 3 repeats the window of line 2 (overlap -1..-1, 4 SMs)"),
    ({"clock_default.csv": b"\xff\xfe\x00bad"}, "clock_default.csv: not UTF-8 text (byte 0xff at 0)"),
    # each of these was converted into a table that replay then refused, naming the output's line
    ({"clock_default.csv": SOURCE_HEADER + "-1,-1,4,1024,nan,2.0\n"},
     "line 2: column '0:time (s)': must be finite and positive, got nan"),
    ({"clock_default.csv": SOURCE_HEADER + "-1,-1,4,1024,0.001,-2.0\n"},
     "line 2: column '0:total energy (J)': must be finite and positive, got -2.0"),
    ({"clock_default.csv": SOURCE_HEADER + "-1,-1,4,1024,0.001,\n"}, "line 2: column '0:total energy (J)': '' is not a number"),
    # a window inside a slot (ops 0-1 are one) crashed the converter with a KeyError
    ({"clock_default.csv": SOURCE_HEADER + "0,3,4,1024,0.001,2.0\n"},
     "line 2: overlap 0..3 is not a window of slots; overlap_start must be one of [0, 2, 3, 5, 6]"),
    ({"clock_default.csv": SOURCE_HEADER + "5,2,4,1024,0.001,2.0\n"}, "line 2: overlap 5..2 is not a window of slots"),
])
def test_converting_a_folder_that_is_not_the_recorded_tables_says_why_and_writes_nothing(tmp_path, capsys, files, says):
    from kareus.hardware.tables import main

    src = tmp_path / "src"
    src.mkdir()
    for name, text in files.items():
        (src / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(SystemExit) as e:
        main([str(src), str(tmp_path / "out" / "table.csv")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("python -m kareus.hardware.tables: error: src: ") and says in err[-1], err
    assert not (tmp_path / "out").exists()  # no folder, no half-written table


@pytest.mark.parametrize("where", ["under_a_file", "a_folder"])
def test_an_output_that_cannot_be_written_is_one_line_and_leaves_nothing(tmp_path, capsys, where):
    """An out path under a file, or naming a folder, raised a traceback and left ``<out>.part`` behind."""
    from kareus.hardware.tables import main

    src = tmp_path / "src"
    src.mkdir()
    (src / "clock_default.csv").write_text(SOURCE_HEADER + "-1,-1,4,1024,0.001,2.0\n")
    (src / "clock_1200mhz.csv").write_text(SOURCE_HEADER + "-1,-1,4,1024,0.001,2.0\n")
    (tmp_path / "afile").write_text("")
    out = tmp_path / "afile" / "t.csv" if where == "under_a_file" else tmp_path / "t.csv"
    if where == "a_folder":
        out.mkdir()
    with pytest.raises(SystemExit) as e:
        main([str(src), str(out)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("python -m kareus.hardware.tables: error: out: "), err
    assert not list(tmp_path.rglob("*.part"))
