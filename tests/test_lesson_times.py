"""The lessons' stated run times: a quiet machine's, with each measurement's load recorded and a
busy machine's run kept from replacing a quiet machine's time unless the lesson grew slower."""

from __future__ import annotations

import json

from course_tools import lesson_times
from grading.grading_times import Load

QUIET, BUSY = Load(0.1, 2), Load(4.0, 2)


def test_a_recorded_run_keeps_the_load_it_ran_at(tmp_path):
    busy = json.loads(lesson_times.record("06_x", "quick", 30.0, tmp_path, load=BUSY).read_text())
    quiet = json.loads(lesson_times.record("06_x", "full", 120.0, tmp_path, load=QUIET).read_text())
    assert (busy["busy"], busy["quiet"], quiet["busy"], quiet["quiet"]) == (4.0, False, 0.1, True)
    measured_now = json.loads(lesson_times.record("07_y", "quick", 5.0, tmp_path).read_text())
    assert measured_now["busy"] >= 0 and isinstance(measured_now["quiet"], bool)


def test_the_run_time_paragraph_says_it_is_a_quiet_machines():
    stated = lesson_times.run_time_paragraph(
        {"quick_s": 10.0, "full_s": 130.0, "cores": 2, "quick_quiet": True, "full_quiet": True}
    )
    assert stated.startswith(
        "**Run time** on a quiet machine with 2 CPU cores: about 10 s with `QUICK = True`, "
        "about 2 min with the full settings."
    )
    assert "with 4 of them busy, about 3 times as long" in stated
    # Times recorded before loads were: stated as they were measured, a quiet machine's.
    assert lesson_times.run_time_paragraph({"quick_s": 10.0, "full_s": 130.0, "cores": 2}) == stated


def test_a_time_measured_on_a_busy_machine_says_so_and_what_a_quiet_one_would_take():
    stated = lesson_times.run_time_paragraph(
        {"quick_s": 30.0, "full_s": 130.0, "cores": 2, "quick_quiet": False, "quick_busy": 4.0, "full_quiet": True}
    )
    assert "while other programs were busy (`QUICK` with 4.0 busy processes on 2 cores)" in stated
    assert "about 30 s with `QUICK = True`, about 2 min with the full settings" in stated
    assert stated.endswith("on a quiet machine, about 10 s and about 2 min.")


def _merged(entry: dict, seconds: float, load: Load, tmp_path) -> dict:
    lesson_times.record("06_x", "quick", seconds, tmp_path, load=load)
    return lesson_times.merge({"06_x": entry}, lesson_times.measured(tmp_path))["06_x"]


def test_a_quiet_machines_time_is_kept_over_a_busy_run_unless_the_lesson_grew_slower(tmp_path):
    stated = {"quick_s": 10.0, "full_s": 100.0, "cores": 2, "quick_quiet": True}
    assert _merged(stated, 25.0, BUSY, tmp_path)["quick_s"] == 10.0  # 25 s at 4 busy: about 8 s quiet
    slower = _merged(stated, 45.0, BUSY, tmp_path)  # 45 s at 4 busy: 15 s quiet, slower than 10 s
    assert (slower["quick_s"], slower["quick_quiet"], slower["quick_busy"]) == (45.0, False, 4.0)
    assert _merged(stated, 12.0, QUIET, tmp_path)["quick_s"] == 12.0  # a quiet run always replaces
    replaced = _merged(slower, 30.0, BUSY, tmp_path)  # a busy run replaces a busy one
    assert replaced["quick_s"] == 30.0
    quiet_again = _merged(replaced, 11.0, QUIET, tmp_path)
    assert (quiet_again["quick_s"], quiet_again["quick_quiet"], quiet_again["quick_busy"]) == (11.0, True, 0.1)
