"""Lab 01 in a real browser: JupyterLab serves it, configured as `make lab` configures it, headless
Chromium runs every cell, and the rendered page shows the progress cell's widgets, its plotly chart,
and no error anywhere; the learner sees none of nbgrader's instructor tools and no news prompt,
and the instructor's JupyterLab (`make lab-instructor`) shows Create Assignment.

Chromium and its driver are Debian's (`make test` installs them): Selenium is pointed at
them explicitly, so it never tries to download a browser or a driver.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from conftest import CHROMEDRIVER, CHROMIUM, REPO, SOLUTION01, answer_cells, headless_chromium, write_learner_notebook

SCREENSHOT = REPO / "build" / "artifacts" / "browser_lab01.png"
# A guard against a hang, never a speed asserted: every wait, from starting JupyterLab to the last
# check, ends by then (on a machine saturated by the rest of the suite the test once took 101 s).
DEADLINE_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _seed_grade(grades: Path) -> None:
    """A recorded grade for the progress cell to show (lab 01 with task 3 failing), as the grader writes it."""
    from grading.check import Verdict
    from grading.grader import CheckResult, GradeReport, TestResult
    from grading.registry import get_check
    from grading.report import write_reports

    wrong = Verdict("lab01.dominant_op_real", False, "dominant_op returned 'aten::matmul'", "", "wrong result")
    report = GradeReport(
        "lab01_gemm",
        "lab01_gemm.ipynb",
        1,
        [
            TestResult("test_task1_gemm_flops", 2, 2, [CheckResult("lab01.gemm_flops", False, True, "passed")]),
            TestResult("test_task2_time_op", 3, 3, [CheckResult("lab01.time_op_warmup", False, True, "passed")]),
            TestResult(
                "test_task3_dominant_op",
                0,
                3,
                [
                    CheckResult(
                        "lab01.dominant_op_real",
                        False,
                        False,
                        wrong.message(get_check("lab01.dominant_op_real"), hidden=False),
                        "wrong result",
                    )
                ],
            ),
            TestResult(
                "test_task4_achieved_tflops", 2, 2, [CheckResult("lab01.achieved_tflops", False, True, "passed")]
            ),
        ],
    )
    write_reports(report, grades / "lab01_gemm")


def _write_settings(folder: Path) -> None:
    """JupyterLab settings for the test: every cell in the DOM (no windowing). Nothing else: the news
    prompt and nbgrader's tools are left to the configuration `make lab` uses."""
    settings = {"@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"}}
    for name, values in settings.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(json.dumps(values))


def _make_lab_environment(target: str) -> dict[str, str]:
    """The variables `make <target>` starts JupyterLab with (the assignments before its command)."""
    printed = subprocess.run(
        ["make", "-n", "--no-print-directory", "-o", ".venv/.installed", target],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert printed.returncode == 0, printed.stderr
    command = [line for line in printed.stdout.splitlines() if "jupyter lab " in line]
    assert len(command) == 1, f"make {target} should run one `jupyter lab` command:\n{printed.stdout}"
    variables = {}
    for word in shlex.split(command[0]):
        name, is_assignment, value = word.partition("=")
        if not (is_assignment and name.isidentifier()):
            break
        variables[name] = value
    assert "JUPYTER_CONFIG_PATH" in variables, f"make {target} sets no JupyterLab configuration: {command[0]}"
    return variables


def _start_lab(root: Path, port: int, token: str, target: str = "lab") -> subprocess.Popen:
    """JupyterLab on ``root``, configured as ``make <target>`` configures it."""
    args = [
        sys.executable,
        "-m",
        "jupyterlab",
        "--no-browser",
        "--ip=127.0.0.1",
        f"--port={port}",
        "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root}",
        f"--LabApp.user_settings_dir={root / '.settings'}",
        f"--LabApp.workspaces_dir={root / '.workspaces'}",
    ]
    if os.geteuid() == 0:
        args.append("--allow-root")
    env = {**os.environ, **_make_lab_environment(target), "JUPYTER_RUNTIME_DIR": str(root / ".runtime")}
    return subprocess.Popen(
        args, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )


def _wait_for_server(proc: subprocess.Popen, port: int, token: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError("JupyterLab exited:\n" + proc.stdout.read().decode(errors="replace")[-3000:])
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={token}", timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    raise AssertionError("JupyterLab did not answer in time")


def _stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


def _until(what: str, condition, deadline: float, every: float = 0.25, state=lambda: ""):
    """Poll ``condition()`` until it returns something truthy, or fail saying what was awaited
    (and ``state()``, what the page showed then)."""
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what} (screenshot: {SCREENSHOT}){state()}")


def _run_all_cells(driver, deadline: float) -> None:
    """Run > Run All Cells, then wait until every code cell has run and the kernel is idle."""
    from selenium.webdriver.common.by import By

    css = lambda selector: driver.find_elements(By.CSS_SELECTOR, selector)  # noqa: E731
    idle = lambda: css(".jp-Notebook-ExecutionIndicator[data-status='idle']")  # noqa: E731
    _until("the notebook to open", lambda: css(".jp-NotebookPanel .jp-Cell"), deadline)
    _until(
        "the kernel to start",
        lambda: idle() and "| Idle" in driver.find_element(By.ID, "jp-main-statusbar").text,
        deadline,
    )
    [item.click() for item in css(".lm-MenuBar-item") if item.text.strip() == "Run"]
    _until(
        "Run > Run All Cells",
        lambda: [item for item in css(".lm-Menu .lm-Menu-item") if item.text.strip() == "Run All Cells"],
        deadline,
    )[0].click()

    def cells() -> str:
        return "".join(
            f"\n  {c.find_element(By.CSS_SELECTOR, '.jp-InputPrompt').text} "
            f"{[o.text[:300] for o in c.find_elements(By.CSS_SELECTOR, '.jp-OutputArea-output')]}"
            for c in css(".jp-CodeCell")
        )

    def finished() -> bool:
        prompts = [p.text.strip() for p in css(".jp-CodeCell .jp-InputPrompt")]
        ran = [bool(re.fullmatch(r"\[\d+\]:", p)) for p in prompts]
        if all(ran):
            return bool(idle())
        if any(ran) and "[*]:" not in prompts and idle():  # the run stopped early: a cell failed
            raise AssertionError(f"Run All Cells stopped before the end (screenshot: {SCREENSHOT}):{cells()}")
        return False

    _until("every cell to run", finished, deadline, state=cells)


def _progress_panel(driver, deadline: float):
    """The progress cell's widget box (found through its button)."""
    from selenium.webdriver.common.by import By

    buttons = _until(
        "the progress cell's button",
        lambda: [
            b
            for b in driver.find_elements(By.CSS_SELECTOR, ".jupyter-widgets.widget-button")
            if b.text.strip() == "Grade this lab now"
        ],
        deadline,
    )
    return buttons[0].find_element(By.XPATH, "./ancestor::div[contains(@class, 'widget-vbox')][1]")


NBGRADER_SERVER_PATHS = ("formgrader", "assignments", "courses")  # what nbgrader's server extensions answer


def _learner_sees_no_instructor_tool(driver, port: int, token: str) -> None:
    """No nbgrader menu, Create Assignment sidebar, Validate button or course list, on the page or
    on the server, and no prompt to fetch Jupyter's news."""
    from selenium.webdriver.common.by import By

    menus = [item.text.strip() for item in driver.find_elements(By.CSS_SELECTOR, ".lm-MenuBar-item")]
    assert "Run" in menus and "Nbgrader" not in menus, menus
    # The sidebars' tabs (by title) and the notebook's toolbar: where nbgrader puts Create Assignment
    # and Validate; the lab's own text is not searched.
    tabs = [tab.get_attribute("title") or tab.text for tab in driver.find_elements(By.CSS_SELECTOR, ".lm-TabBar-tab")]
    toolbar = " ".join(bar.text for bar in driver.find_elements(By.CSS_SELECTOR, ".jp-NotebookPanel-toolbar"))
    assert not [tab for tab in tabs if "Assignment" in tab or "Course" in tab], tabs
    assert "Validate" not in toolbar, toolbar
    nbgrader = driver.find_elements(By.CSS_SELECTOR, "#jp-mainmenu-nbgrader, [data-id^='nbgrader'], .validate-button")
    assert not nbgrader, [element.get_attribute("outerHTML")[:200] for element in nbgrader]
    shown = driver.find_element(By.TAG_NAME, "body").text
    assert "Jupyter news" not in shown, f"a learner's JupyterLab asks about Jupyter's news (screenshot: {SCREENSHOT})"
    for path in NBGRADER_SERVER_PATHS:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/{path}?token={token}", timeout=10) as answer:
                raise AssertionError(f"/{path} answered {answer.status}: nbgrader's server extensions are on")
        except urllib.error.HTTPError as refused:
            assert refused.code == 404, f"/{path}: {refused.code}"


def _instructor_sees_create_assignment(driver, port: int, token: str, deadline: float) -> None:
    from selenium.webdriver.common.by import By

    driver.get(f"http://127.0.0.1:{port}/lab?token={token}")
    tab = _until(
        "the instructor's Create Assignment sidebar",
        lambda: driver.find_elements(By.CSS_SELECTOR, ".lm-TabBar-tab[data-id^='nbgrader-create']"),
        deadline,
    )
    assert tab[0].get_attribute("title") or tab[0].text, tab[0].get_attribute("outerHTML")[:300]
    assert "Nbgrader" in [item.text.strip() for item in driver.find_elements(By.CSS_SELECTOR, ".lm-MenuBar-item")]


def test_lab01_runs_in_jupyterlab_and_renders_widgets_and_a_chart(tmp_path):
    from selenium.webdriver.common.by import By

    deadline = time.monotonic() + DEADLINE_S
    assert Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists(), (
        "install Chromium and its driver: apt-get install -y chromium chromium-driver (make test does it as root)"
    )
    write_learner_notebook(tmp_path / "lab01_gemm.ipynb", answer_cells(SOLUTION01))
    _seed_grade(tmp_path / "grades")
    _write_settings(tmp_path / ".settings")
    port, token = _free_port(), secrets.token_hex(16)
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    SCREENSHOT.unlink(missing_ok=True)
    lab = _start_lab(tmp_path, port, token)
    instructor_root = tmp_path / "instructor"  # its own folder: nothing to open, no kernel to start
    _write_settings(instructor_root / ".settings")
    instructor_port = _free_port()
    instructor = _start_lab(instructor_root, instructor_port, token, target="lab-instructor")
    driver = None
    try:
        _wait_for_server(lab, port, token, deadline)
        driver = headless_chromium()
        driver.get(f"http://127.0.0.1:{port}/lab/tree/lab01_gemm.ipynb?token={token}")
        _run_all_cells(driver, deadline)

        outputs = [o.text for o in driver.find_elements(By.CSS_SELECTOR, ".jp-OutputArea-output")]
        # An error output has a traceback, or a line that starts with the exception's name; a line that
        # merely names an exception (a check saying what must raise ValueError) is not one.
        failed = [o for o in outputs if "Traceback" in o or re.search(r"^\w+(Error|Exception): ", o, re.M)]
        assert not failed, f"a cell failed (screenshot: {SCREENSHOT}): {failed}"
        passed = [
            o
            for o in outputs
            if re.fullmatch(r"\N{CHECK MARK} lab01\.\w+ passed", o.strip().splitlines()[0])
            and "the grader also checks" in o
        ]
        assert len(passed) == 4, outputs  # the four visible checks, each saying what the grader still checks
        assert any("GFLOP/s" in o for o in outputs)  # the last cell measured a GEMM with the learner's tools

        panel = _progress_panel(driver, deadline)  # a rendered ipywidgets box: text, chart, button
        assert "lab01_gemm: 7/10 points" in panel.text and "lab01.dominant_op_real (wrong result)" in panel.text
        chart = _until(
            "the progress chart", lambda: panel.find_elements(By.CSS_SELECTOR, ".js-plotly-plot .main-svg"), deadline
        )
        assert chart[0].size["width"] > 200 and chart[0].size["height"] > 100
        assert len(panel.find_elements(By.CSS_SELECTOR, ".js-plotly-plot .bars .point")) == 8  # 4 tests, 2 bars each
        driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", panel)
        time.sleep(0.5)  # let the scroll settle before the screenshot
        driver.save_screenshot(str(SCREENSHOT))
        _learner_sees_no_instructor_tool(driver, port, token)

        _wait_for_server(instructor, instructor_port, token, deadline)
        _instructor_sees_create_assignment(driver, instructor_port, token, deadline)
    finally:
        try:
            if driver is not None:
                driver.save_screenshot(
                    str(SCREENSHOT.with_name("browser_lab_instructor.png"))
                    if driver.current_url.startswith(f"http://127.0.0.1:{instructor_port}")
                    else str(SCREENSHOT)
                )
                print(f"screenshots: {SCREENSHOT.parent}")
        finally:
            if driver is not None:
                driver.quit()
            _stop(lab)
            _stop(instructor)


def _make_browser(**variables: str) -> subprocess.CompletedProcess:
    args = [f"{name}={value}" for name, value in variables.items()]
    return subprocess.run(
        ["make", "--no-print-directory", "browser", *args], cwd=REPO, capture_output=True, text=True, timeout=60
    )


def test_make_test_gets_the_browser_first(tmp_path):
    """`make test` depends on `make browser`: nothing to do when both programs are there, an apt-get
    install as root when one is missing, and the command to run for anyone else."""
    rule = re.search(r"^test:(.*)$", (REPO / "Makefile").read_text(), re.M)
    assert rule and "browser" in rule.group(1).split()
    present = _make_browser()
    assert present.returncode == 0 and present.stdout == "", present.stdout + present.stderr
    missing = str(tmp_path / "chromium")
    as_root = _make_browser(CHROMIUM=missing, USER_ID="0", APT_GET="echo apt-get")
    assert as_root.returncode == 0, as_root.stderr
    assert as_root.stdout.splitlines()[1:] == ["apt-get update", "apt-get install -y chromium chromium-driver"]
    as_user = _make_browser(CHROMEDRIVER=missing, USER_ID="1000", APT_GET="false")
    assert as_user.returncode != 0 and as_user.stdout == ""
    assert "sudo apt-get update && sudo apt-get install -y chromium chromium-driver" in as_user.stderr
    no_sandbox = _make_browser(BWRAP=str(tmp_path / "bwrap"), USER_ID="0", APT_GET="echo apt-get")
    assert no_sandbox.stdout.splitlines()[1:] == ["apt-get update", "apt-get install -y bubblewrap"]


def test_site_formulas_render_as_mathml_in_chromium(tmp_path):
    """A site page built without running its lesson: each display formula is laid out as maths by the
    browser itself (a fraction's numerator sits above its denominator), and no TeX shows."""
    import nbformat
    from selenium.webdriver.common.by import By

    from course_tools.site.build import build_site

    assert Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists(), (
        "install Chromium and its driver: apt-get install -y chromium chromium-driver (make test does it as root)"
    )
    (lesson,), _ = build_site(REPO / "notebooks", tmp_path, only={"02"}, execute=False, progress=False)
    screenshot = SCREENSHOT.with_name("browser_site_maths.png")
    screenshot.parent.mkdir(parents=True, exist_ok=True)
    driver = headless_chromium()
    try:
        driver.get((tmp_path / lesson.page).as_uri())
        formulas = driver.find_elements(By.CSS_SELECTOR, "math[display='block']")
        written = sum(
            c.source.count("$$") // 2
            for c in nbformat.read(lesson.path, as_version=4).cells
            if c.cell_type == "markdown"
        )
        assert len(formulas) == written > 0, f"{written} display formulas in {lesson.path.name}, {len(formulas)} shown"
        for formula in formulas:
            assert driver.execute_script("return getComputedStyle(arguments[0]).display", formula) == "block math"
            assert formula.size["width"] > 0 and formula.size["height"] > 0, formula.get_attribute("outerHTML")
        fraction = driver.find_element(By.CSS_SELECTOR, "math[display='block'] mfrac")
        numerator, denominator = driver.execute_script(
            "return Array.from(arguments[0].children, c => c.getBoundingClientRect().toJSON())", fraction
        )
        assert numerator["bottom"] <= denominator["top"] and numerator["height"] > 0, (numerator, denominator)
        assert abs(numerator["left"] + numerator["width"] / 2 - denominator["left"] - denominator["width"] / 2) < 5
        shown = driver.find_element(By.TAG_NAME, "body").text
        assert not [tex for tex in ("$$", "\\frac", "\\text", "\\min") if tex in shown], "raw TeX is visible"
        driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", fraction)
    finally:
        driver.save_screenshot(str(screenshot))
        driver.quit()
