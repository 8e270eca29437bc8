"""Progress display: rich bars on a terminal, one line per partition in logs, silence when off."""
from __future__ import annotations

import io

from rich.console import Console

from kareus.tracking.progress import (NullProgress, PlainProgress, ProgressListener, format_seconds,
                                      make_progress)
from tracking_fakes import search_events


class Terminal(io.StringIO):
    """A stream that is a terminal."""

    def isatty(self) -> bool:
        return True


def test_modes_follow_setting_and_terminal():
    tty = Console(file=Terminal(), force_terminal=True)
    pipe = Console(file=io.StringIO(), force_terminal=False)
    assert isinstance(make_progress("simulated", False, console=tty), NullProgress)
    assert not isinstance(make_progress("simulated", False, console=tty), PlainProgress)
    assert isinstance(make_progress("simulated", True, console=tty), ProgressListener)
    plain = make_progress("simulated", True, console=pipe)
    assert isinstance(plain, PlainProgress) and not isinstance(plain, ProgressListener)
    # FORCE_COLOR (many CI systems set it) makes rich call a pipe a terminal: a live bar there wrote
    # cursor codes into the results
    forced = make_progress("simulated", True, console=Console(file=io.StringIO(), force_terminal=True))
    assert isinstance(forced, PlainProgress) and not isinstance(forced, ProgressListener)


def test_rich_progress_tracks_each_partition():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=140)
    with make_progress("simulated", True, console=console, interactive=True) as progress:
        events = search_events("fwd_attn", n=8, batch=4, budget=10)
        for event in events[:6] + search_events("bwd_mlp", n=4, batch=4)[:-1]:  # interleaved partitions
            progress(event)
        task = progress.progress.tasks[progress.tasks["fwd_attn"]]
        assert (task.completed, task.total) == (4, 10)
        assert task.fields["hv"] != "-" and task.fields["gpu"] == "1.0 s"
        for event in events[6:]:
            progress(event)
        task = progress.progress.tasks[progress.tasks["fwd_attn"]]
        assert task.completed == 8 and task.fields["hv"] == f"{events[-1].hypervolume_ratio:.4f}"
        assert task.fields["status"] == "done" and progress.progress.tasks[progress.tasks["bwd_mlp"]].fields["status"] == ""
        assert progress.progress.tasks[progress.tasks["bwd_mlp"]].completed == 4
    text = out.getvalue()
    assert "fwd_attn" in text and "sim GPU" in text
    replayed = Console(file=io.StringIO(), force_terminal=True, width=140)
    with make_progress("replayed", True, console=replayed, interactive=True) as progress:
        for event in search_events("fwd_attn", n=4, batch=4):
            progress(event)
    assert "replayed GPU" in replayed.file.getvalue()


def test_plain_progress_writes_one_line_per_finished_search():
    lines: list[str] = []
    progress = PlainProgress("simulated", write=lines.append)
    for event in search_events("fwd_attn", n=8, batch=4, budget=10):
        progress(event)
    assert len(lines) == 1
    assert lines[0].startswith("partition fwd_attn: profiled 8/10, 1 failed")
    assert "simulated GPU time 2.0 s" in lines[0]
    assert PlainProgress("replayed", write=lines.append).gpu_label == "replayed GPU time"
    assert PlainProgress("", write=lines.append).gpu_label == "GPU time"


def test_null_progress_prints_nothing(capsys):
    with make_progress("simulated", False) as progress:
        for event in search_events("fwd_attn", n=4, batch=4):
            progress(event)
    assert capsys.readouterr() == ("", "")


def test_format_seconds():
    assert format_seconds(42.0) == "42.0 s"
    assert format_seconds(210.0) == "3.5 min"
    assert format_seconds(7560.0) == "2.10 h"
    assert format_seconds(float("nan")) == "-"


def test_on_a_terminal_the_runs_log_file_still_gets_each_partitions_line(tmp_path):
    """The bars replaced the plain lines everywhere: ``kareus.log`` of a run started on a terminal held
    nothing of its searches. The line goes to the log file alone; the terminal has the bars."""
    import logging

    root = logging.getLogger()
    handler, console_handler = logging.FileHandler(tmp_path / "kareus.log"), logging.StreamHandler(io.StringIO())
    root.addHandler(handler)
    root.addHandler(console_handler)
    level = root.level
    root.setLevel(logging.INFO)
    try:
        out = io.StringIO()
        with make_progress("simulated", True, console=Console(file=out, force_terminal=True, width=140), interactive=True) as progress:
            for event in search_events("fwd_attn", n=8, batch=4, budget=10):
                progress(event)
    finally:
        root.removeHandler(handler)
        root.removeHandler(console_handler)
        root.setLevel(level)
        handler.close()
    [line] = (tmp_path / "kareus.log").read_text().splitlines()
    assert line.startswith("partition fwd_attn: profiled 8/10, 1 failed")
    assert console_handler.stream.getvalue() == "" and "partition fwd_attn: profiled" not in out.getvalue()
