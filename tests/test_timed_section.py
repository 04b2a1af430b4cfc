"""timed_section: the thread count it chooses for a load, what it restores, and the lines its checks print."""

from __future__ import annotations

import pytest
import torch

import infra_lib.timed_section as ts
from infra_lib.timed_section import MachineLoad, TimedSection, choose_threads, measure_load, timed_section


def section_for(load: MachineLoad, threads: int = 1) -> TimedSection:
    return TimedSection(
        threads=threads, previous_threads=threads, reason="test", before=load, others_busy_during=load.others_busy_cores
    )


QUIET = MachineLoad(cores=4, others_busy_cores=0.1, load_average=0.3)
HALF_BUSY = MachineLoad(cores=4, others_busy_cores=2.0, load_average=3.0)
FULL = MachineLoad(cores=2, others_busy_cores=2.0, load_average=4.5)


def test_choose_threads_uses_every_core_on_a_quiet_machine():
    threads, reason = choose_threads(QUIET, most=4)
    assert threads == 4, f"a quiet 4-core machine should get 4 threads, got {threads}"
    assert "0.1 of 4 cores" in reason


def test_choose_threads_leaves_the_busy_cores_alone():
    assert choose_threads(HALF_BUSY, most=4)[0] == 2, "2 of 4 cores taken by others: 2 threads"
    threads, reason = choose_threads(FULL, most=2)
    assert threads == 1, "a fully busy machine still gets one thread"
    assert "waiting for a core" in reason, f"the reason should say why fewer threads: {reason!r}"


def test_choose_threads_counts_a_lightly_used_core_as_free():
    light = MachineLoad(cores=2, others_busy_cores=0.2, load_average=None)
    assert choose_threads(light, most=2)[0] == 2, "a core used 20% by others counts as free"
    assert choose_threads(MachineLoad(2, 0.4, None), most=2)[0] == 1, "a core used 40% by others does not"


def test_choose_threads_never_exceeds_most():
    threads, reason = choose_threads(QUIET, most=1)
    assert threads == 1
    assert "1 is the most" in reason
    with pytest.raises(ValueError, match="most must be >= 1"):
        choose_threads(QUIET, most=0)


def test_measure_load_reports_the_usable_cores_and_a_share_within_them():
    load = measure_load(0.05)
    assert load.cores == ts.usable_cores() >= 1
    assert 0.0 <= load.others_busy_cores <= load.cores
    with pytest.raises(ValueError, match="sample_s must be > 0"):
        measure_load(0)


def test_others_busy_subtracts_this_process(monkeypatch):
    # wall, busy CPU seconds of all programs, this process's CPU seconds
    readings = iter([(100.0, 50.0, 10.0), (102.0, 54.0, 12.0)])
    monkeypatch.setattr(ts, "_cpu_counters", lambda: next(readings))
    monkeypatch.setattr(ts, "usable_cores", lambda: 4)
    start = ts._cpu_counters()
    assert ts._others_busy_since(start) == pytest.approx(1.0), "4 busy CPU seconds, 2 our own, over 2 s: 1 core"


def test_timed_section_sets_and_restores_the_thread_count(monkeypatch, capsys):
    monkeypatch.setattr(ts, "measure_load", lambda sample_s: FULL)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with timed_section() as section:
            assert torch.get_num_threads() == 1, "a fully busy machine: the timed block runs on one thread"
        assert torch.get_num_threads() == 2, "the thread count must be restored after the block"
        assert section.threads == 1 and section.previous_threads == 2
        assert section.others_busy_during is not None
        assert "timing with 1 torch thread" in capsys.readouterr().out
        with pytest.raises(RuntimeError), timed_section(show=False):
            raise RuntimeError("the timed code failed")
        assert torch.get_num_threads() == 2, "the thread count must be restored after an error too"
        assert capsys.readouterr().out == "", "show=False prints nothing"
    finally:
        torch.set_num_threads(before)


def test_timed_section_respects_most_threads(monkeypatch):
    monkeypatch.setattr(ts, "measure_load", lambda sample_s: QUIET)
    monkeypatch.setattr(ts, "usable_cores", lambda: 4)
    with timed_section(most_threads=1, show=False) as section:
        assert torch.get_num_threads() == 1
    assert section.threads == 1


def test_check_prints_a_tick_when_the_pattern_holds(capsys):
    section = section_for(FULL)
    assert section.check(True, "batch 8 faster per token", "5.0x") is True
    out = capsys.readouterr().out
    assert out.startswith("✓ expected batch 8 faster per token, and this run measured 5.0x.")
    assert section.checks == [(True, out.strip())]


def test_check_on_a_busy_machine_says_disturbed_how_busy_and_what_to_do(capsys):
    section = section_for(FULL)
    assert section.check(False, "batch 8 faster per token", "0.3x") is False
    note = capsys.readouterr().out
    assert "⚠ Unexpected result: expected batch 8 faster per token, but this run measured 0.3x." in note
    for part in ("disturbed", "2.0 of 2 cores", "1 torch thread", "load average 4.5", "rerun this cell"):
        assert part in note, f"the note should mention {part!r}: {note!r}"


def test_check_on_a_quiet_machine_does_not_blame_the_load():
    note = section_for(QUIET, threads=4).note(False, "first call slower than warm", "1.0x")
    assert "looked quiet" in note and "disturbed" not in note
    assert "4 torch threads" in note and "Rerun this cell" in note
