"""A class on the course's JupyterHub, end to end, with the README's commands as written.

On a copy of the course, ``make hub ROSTER=roster.txt`` starts the hub for four learners: alice
(honest, and submits twice), bob (a typical mistake, submitted late), mallory (hostile: her answers read
the answer key, and her server looks for everything a cheat would want) and dave (never submits).
Each learner's server is driven through the hub's REST API and the learner's own Jupyter server
API: the README's learner commands run in a kernel of that server, the notebook is answered through
the contents API. The instructor's commands run in the course folder. Then: the scores equal those
of the same notebooks graded from a folder, each learner fetched their own feedback and no one
else's, mallory reached nothing of anyone else's, and nothing the test started is left running.
"""

from __future__ import annotations

import asyncio
import csv
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import nbformat
import pytest
from conftest import CHROMEDRIVER, CHROMIUM, LAB01, REPO, SOLUTION01, answer_cells, course_copy, headless_chromium

from course_tools.hub import free_port

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("hub")]

LAB = "lab01_gemm"
HOSTILE = REPO / "tests" / "adversarial" / "answer_key_reader.ipynb"
SCREENSHOT = REPO / "build" / "artifacts" / "browser_hub_lab01.png"
MISTAKE = {"task1_gemm_flops": "def gemm_flops(m, n, k):\n    return m * n * k\n"}  # forgets the 2 of a multiply-add


# Run in mallory's server: what she can read of each path, whose processes she sees, what the answer
# key in her view holds.
PROBE = """
import json, os
found = {}
for what, path in PROBES.items():
    try:
        found[what] = sorted(os.listdir(path)) if os.path.isdir(path) else open(path, "rb").read(64).hex()
    except OSError as exc:
        found[what] = "refused: " + type(exc).__name__
mine = os.getuid()
found["processes of others"] = [
    open(f"/proc/{p}/cmdline", "rb").read().split(b"\\0")[0].decode()
    for p in os.listdir("/proc")
    if p.isdigit() and os.stat(f"/proc/{p}").st_uid != mine
]
key = json.load(open(KEY))
found["answer key in view"] = [
    "".join(c["source"]) for c in key["cells"] if c.get("metadata", {}).get("nbgrader", {}).get("solution")
]
print(json.dumps(found))
"""


def readme_blocks() -> list[str]:
    """The bash blocks of the README's "Running a class on a JupyterHub", in order."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split("### Running a class on a JupyterHub", 1)[1].split("\n### ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    assert len(blocks) == 5, "the section's commands: start, release, a learner's work, the instructor's, feedback"
    return blocks


class Server:
    """A learner's JupyterLab behind the hub, driven with a token the hub issued for them."""

    def __init__(self, hub_url: str, admin: dict, name: str):
        self.name, self.hub_url = name, hub_url
        made = httpx.post(f"{hub_url}/hub/api/users/{name}/tokens", headers=admin, json={"note": "test"}, timeout=30)
        made.raise_for_status()
        self.headers = {"Authorization": f"token {made.json()['token']}"}
        self.base = f"{hub_url}/user/{name}"
        self.kernel = None

    def start(self, admin: dict, timeout_s: float = 180) -> None:
        httpx.post(f"{self.hub_url}/hub/api/users/{self.name}/server", headers=admin, timeout=60)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            user = httpx.get(f"{self.hub_url}/hub/api/users/{self.name}", headers=admin, timeout=30).json()
            server = user.get("servers", {}).get("", {})
            if server.get("ready"):
                return
            time.sleep(0.5)
        raise AssertionError(f"{self.name}'s server did not start in {timeout_s} s")

    def get(self, path: str) -> httpx.Response:
        return httpx.get(f"{self.base}/{path}", headers=self.headers, timeout=60)

    def put(self, path: str, body: dict) -> httpx.Response:
        return httpx.put(f"{self.base}/{path}", headers=self.headers, json=body, timeout=60)

    def run(self, code: str, timeout_s: float = 300) -> str:
        """Run ``code`` in a kernel of this server; return what it printed (AssertionError on an error)."""
        if self.kernel is None:
            started = httpx.post(f"{self.base}/api/kernels", headers=self.headers, json={"name": "python3"}, timeout=60)
            started.raise_for_status()
            self.kernel = started.json()["id"]
        return asyncio.run(self._execute(code, timeout_s))

    async def _execute(self, code: str, timeout_s: float) -> str:
        from tornado.httpclient import HTTPRequest
        from tornado.websocket import websocket_connect

        url = self.base.replace("http://", "ws://") + f"/api/kernels/{self.kernel}/channels"
        socket = await websocket_connect(HTTPRequest(url, headers=self.headers, connect_timeout=60))
        msg_id, session = uuid.uuid4().hex, uuid.uuid4().hex
        header = {"msg_id": msg_id, "username": self.name, "session": session, "msg_type": "execute_request"}
        content = {"code": code, "silent": False, "store_history": False, "allow_stdin": False, "stop_on_error": True}
        request = {"header": {**header, "version": "5.3"}, "parent_header": {}, "metadata": {}, "content": content}
        await socket.write_message(json.dumps({**request, "channel": "shell", "buffers": []}))
        printed, errors = [], []
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                left = deadline - time.monotonic()
                raw = await asyncio.wait_for(socket.read_message(), timeout=max(left, 0.1))
                if raw is None:
                    raise AssertionError(f"{self.name}'s kernel closed its channels")
                message = json.loads(raw)
                if message.get("parent_header", {}).get("msg_id") != msg_id:
                    continue
                kind = message["header"]["msg_type"]
                if kind == "stream":
                    printed.append(message["content"]["text"])
                elif kind == "error":
                    errors.append("\n".join(message["content"]["traceback"]))
                elif kind == "status" and message["content"]["execution_state"] == "idle":
                    break
        finally:
            socket.close()
        assert not errors, f"{self.name}'s cell failed:\n" + "\n".join(errors)
        return "".join(printed)

    def shell(self, commands: str) -> dict:
        """Run shell commands (a README block) in this learner's server, as a terminal there would."""
        code = (
            "import json, subprocess\n"
            f"r = subprocess.run({commands!r}, shell=True, executable='/bin/bash', capture_output=True, text=True)\n"
            "print(json.dumps({'rc': r.returncode, 'out': r.stdout, 'err': r.stderr}))\n"
        )
        return json.loads(self.run(code).strip().splitlines()[-1])

    def assignments(self, action: str) -> dict:
        """What the Assignments tab does for ``action`` (fetch, submit), through nbgrader's server extension."""
        form = {"course_id": "infra-course", "assignment_id": LAB}
        answered = httpx.post(f"{self.base}/assignments/{action}", headers=self.headers, data=form, timeout=120)
        result = answered.json() if answered.status_code == 200 else {"success": False, "value": answered.text}
        return {"rc": 0 if result.get("success") else 1, "out": str(result.get("value"))[:2000], "err": ""}

    def answer(self, answers: dict[str, str]) -> dict:
        """Fill the fetched lab's answer cells (by grade_id) through the contents API; the notebook saved."""
        path = f"api/contents/{LAB}/{LAB}.ipynb"
        got = self.get(path)
        assert got.status_code == 200, f"{self.name} has no fetched {LAB}: {got.status_code} {got.text[:300]}"
        notebook = got.json()["content"]
        for cell in notebook["cells"]:
            grade_id = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")
            if grade_id in answers:
                cell["source"] = answers[grade_id]
        saved = self.put(path, {"type": "notebook", "format": "json", "content": notebook})
        assert saved.status_code == 200, saved.text[:300]
        return notebook


def bash(block: str, cwd: Path, env: dict, timeout: float = 600) -> str:
    run = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    log = run.stdout + run.stderr
    assert run.returncode == 0, f"{block}\nfailed:\n{log[-4000:]}"
    return log


def _processes_of(marker: str, uids: set[int]) -> list[str]:
    import psutil

    found = []
    for process in psutil.process_iter(["pid", "cmdline", "uids"]):
        try:
            line = " ".join(process.info["cmdline"] or [])
            if marker in line or (process.info["uids"] and process.info["uids"].real in uids):
                found.append(f"{process.info['pid']}: {line[:200]}")
        except psutil.Error:
            continue
    return found


def _as_in_a_terminal() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """The README's `make hub ROSTER=roster.txt` on a copy of the course, stopped as Ctrl-C stops it."""
    tmp = tmp_path_factory.mktemp("hub")
    course = course_copy(tmp / "course")
    (course / "hub" / "node_modules").symlink_to(REPO / "hub" / "node_modules")
    (course / "roster.txt").write_text("alice\nbob\nmallory\ndave\n", encoding="utf-8")
    token, port, folder = secrets.token_hex(16), free_port(), tmp / "class"
    env = {
        **os.environ,
        "INFRA_COURSE_ROOT": str(course),
        "INFRA_HUB_API_TOKEN": token,
        "HUB_ARGS": f"--port {port} --dir {folder}",
        # the instructor's commands run with the venv activated, as the README says
        "VIRTUAL_ENV": str(course / ".venv"),
        "PATH": f"{course / '.venv' / 'bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}",
    }
    start = readme_blocks()[0].split("#", 1)[0].strip()
    assert start == "make hub ROSTER=roster.txt", start
    log = open(tmp / "make_hub.log", "w")
    began = time.monotonic()
    process = subprocess.Popen(
        ["bash", "-c", start],
        cwd=course,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        # as in a terminal, where Ctrl-C interrupts: a test worker may run with SIGINT ignored or
        # blocked, which every process it starts would inherit
        preexec_fn=_as_in_a_terminal,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert process.poll() is None, (tmp / "make_hub.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (tmp / "make_hub.log").read_text()[-3000:]
            try:
                if (
                    httpx.get(f"{url}/hub/api/", timeout=2).status_code == 200
                    and "Ctrl-C" in (tmp / "make_hub.log").read_text()
                ):
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        info = {
            "url": url,
            "admin": {"Authorization": f"token {token}"},
            "course": course,
            "folder": folder,
            "env": env,
            "timings": {"make hub (edition, homes, hub up)": time.monotonic() - began},
            "log": tmp / "make_hub.log",
        }
        yield info
    finally:
        users = json.loads((folder / "users.json").read_text()) if (folder / "users.json").is_file() else {}
        os.killpg(process.pid, signal.SIGINT)  # Ctrl-C in make hub's terminal
        try:
            process.wait(120)  # a guard against a hang, not a speed
            stopped = True
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            stopped = False
        log.close()
        time.sleep(1)
        left = _processes_of(str(folder), set(users.values()))
        assert stopped, "make hub did not stop on Ctrl-C: " + (tmp / "make_hub.log").read_text()[-2000:]
        assert "stopping the hub" in (tmp / "make_hub.log").read_text()
        assert not left, f"still running after Ctrl-C: {left}"


def test_a_class_round_trip_on_the_hub(hub):
    url, admin, course, folder, env = hub["url"], hub["admin"], hub["course"], hub["folder"], hub["env"]
    timings = hub["timings"]
    blocks = readme_blocks()
    exchange = course / "exchange"

    # sign-in: the roster's passwords, and no one else
    passwords = dict(csv.reader((folder / "passwords.csv").read_text().splitlines()[1:]))
    assert set(passwords) == {"instructor", "alice", "bob", "mallory", "dave"}
    assert (folder / "passwords.csv").stat().st_mode & 0o077 == 0, "passwords.csv is readable by others"
    with httpx.Client(base_url=url, timeout=30) as browser:
        browser.get("/hub/login")
        xsrf = browser.cookies.get("_xsrf")
        for name, password, ok in (("alice", passwords["alice"], True), ("alice", "guess", False)):
            answered = browser.post("/hub/login", data={"username": name, "password": password, "_xsrf": xsrf})
            assert (answered.status_code == 302) == ok, (name, password, answered.status_code)
        outsider = browser.post("/hub/login", data={"username": "eve", "password": "x", "_xsrf": xsrf})
        assert outsider.status_code != 302

    began = time.monotonic()
    bash(blocks[1], course, env)  # nbgrader release_assignment lab01_gemm
    timings["release"] = time.monotonic() - began

    servers = {name: Server(url, admin, name) for name in ("alice", "bob", "mallory")}
    for name, server in servers.items():
        began = time.monotonic()
        server.start(admin)
        timings[f"{name}'s server started"] = time.monotonic() - began
    fetch, grade, submit = blocks[2].strip().splitlines()
    for name, server in servers.items():
        began = time.monotonic()
        # mallory uses the Assignments tab (nbgrader's server extension), the others a terminal
        done = server.assignments("fetch") if name == "mallory" else server.shell(fetch)
        timings[f"{name}: fetch"] = time.monotonic() - began
        assert done["rc"] == 0, done
    home = {name: folder / "homes" / name for name in servers}
    uids = json.loads((folder / "users.json").read_text())
    assert (home["alice"] / LAB / f"{LAB}.ipynb").stat().st_uid == uids["alice"], "alice's files are not hers"

    solution = answer_cells(SOLUTION01)
    written: dict[str, dict] = {}

    def submit_as(name: str, answers: dict) -> None:
        written[name] = servers[name].answer(answers)
        began = time.monotonic()
        done = servers[name].assignments("submit") if name == "mallory" else servers[name].shell(submit)
        timings.setdefault(f"{name}: submit", time.monotonic() - began)
        assert done["rc"] == 0, done

    # alice works, grades her own notebook in her server as the progress cell does, and submits
    # twice: the later counts
    submit_as("alice", {"task1_gemm_flops": solution["task1_gemm_flops"]})
    servers["alice"].answer(solution)
    began = time.monotonic()
    graded = servers["alice"].shell(grade)
    timings["alice: infra-lab grade in her server"] = time.monotonic() - began
    assert graded["rc"] == 0 and "10/10" in graded["out"] + graded["err"], graded
    submit_as("alice", solution)
    # bob submits the lab untouched on time, then his answers after the due date
    submit_as("bob", {})
    time.sleep(1.5)
    due = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    bash(f'nbgrader db assignment add {LAB} --duedate "{due}"', course, env)
    time.sleep(1.5)
    submit_as("bob", {**solution, **MISTAKE})
    # mallory's answers read the answer key
    submit_as("mallory", answer_cells(HOSTILE))

    # what mallory's server can reach
    inbound = exchange / "infra-course" / "inbound"
    alices = sorted(inbound.glob(f"alice+{LAB}+*"))
    assert len(alices) == 2, "both of alice's submissions stay in the exchange"
    probes = {
        "the instructor's answer key": course / "solutions" / LAB / f"{LAB}.ipynb",
        "the instructor's gradebook": course / "gradebook.db",
        "the instructor's course": course,
        "alice's home on the machine": home["alice"],
        "alice's home": Path("/home/alice"),
        "alice's notebook": home["alice"] / LAB / f"{LAB}.ipynb",
        "alice's submission in the exchange": alices[-1] / f"{LAB}.ipynb",
        "the exchange's submissions": inbound,
        "the hub's passwords": folder / "passwords.csv",
        "the hub's database": folder / "state" / "jupyterhub.sqlite",
    }
    key_in_view = REPO / "solutions" / LAB / f"{LAB}.ipynb"
    code = PROBE.replace("PROBES", repr({k: str(v) for k, v in probes.items()})).replace("KEY", repr(str(key_in_view)))
    reached = json.loads(servers["mallory"].run(code).strip().splitlines()[-1])
    # of the course's folder she sees only the mount point of the exchange, which her view shows there
    assert reached.pop("the instructor's course") == ["exchange"], "mallory sees the instructor's course"
    for what in probes.keys() & reached.keys():
        assert str(reached[what]).startswith("refused"), f"mallory reached {what}: {reached[what]}"
    # her processes are alone in their namespace, with bubblewrap's first process (root's, pid 1)
    assert [Path(line).name for line in reached["processes of others"]] == ["bwrap"], reached["processes of others"]
    stubs = answer_cells(LAB01)
    assert sorted(reached["answer key in view"]) == sorted(stubs.values()), "the key in her view holds answers"

    # the instructor collects, grades in the sandbox, returns feedback, exports the gradebook
    collect, grade_class, place, release, gradebook = blocks[3].strip().splitlines()
    for step, line in (("collect", collect), ("grading the class", grade_class), ("feedback", place + "\n" + release)):
        began = time.monotonic()
        bash(line, course, env)
        timings[step] = time.monotonic() - began
    bash(gradebook, course, env)
    with open(course / "grades" / LAB / "scores.csv", newline="") as f:
        scores = {row["learner"]: row for row in csv.DictReader(f)}
    assert {name: float(row["score"]) for name, row in scores.items()} == {
        "alice": 10.0,
        "bob": 8.0,  # his late submission counts: collect looks at no deadline
        "mallory": 0.0,
        "dave": 0.0,
    }, scores
    assert scores["dave"]["status"] == "not submitted" and scores["mallory"]["status"] == "blocked", scores
    assert "the answer key (looked for not found" in scores["mallory"]["flags"], scores["mallory"]
    assert (course / "grades" / "gradebook.csv").is_file() and (course / "grades" / "canvas.csv").is_file()

    # the instructor's server runs in the course folder with nbgrader's formgrader
    instructor = Server(url, admin, "instructor")
    instructor.start(admin)
    formgrader = instructor.get("formgrader/api/assignments")
    assert formgrader.status_code == 200 and LAB in formgrader.text, formgrader.text[:500]

    # the same notebooks graded from a folder give the same scores
    folder_class = course / "from_a_folder"
    folder_class.mkdir()
    for name, notebook in written.items():
        nbformat.write(nbformat.from_dict(notebook), folder_class / f"{name}.ipynb")
    out = course / "folder_grades"
    bash(f"infra-lab grade --submissions {folder_class} --lab {LAB} --out {out}", course, env)
    with open(course / "folder_grades" / "scores.csv", newline="") as f:
        again = {row["learner"]: float(row["score"]) for row in csv.DictReader(f)}
    assert again == {name: float(scores[name]["score"]) for name in written}, (again, scores)

    # each learner fetches their own feedback, and no one else's
    for name, server in servers.items():
        began = time.monotonic()
        done = server.shell(blocks[4].split("#", 1)[0].strip())
        timings[f"{name}: fetch_feedback"] = time.monotonic() - began
        assert done["rc"] == 0, done
        fetched = sorted((home[name] / LAB / "feedback").glob(f"*/{LAB}.html"))
        assert len(fetched) == 1, (name, fetched)
        assert fetched[0].read_bytes() == (course / "grades" / LAB / name / "feedback.html").read_bytes()
    listing = servers["mallory"].shell(f"ls {exchange / 'infra-course' / 'feedback'}")
    assert listing["rc"] != 0 and "Permission denied" in listing["err"], listing

    # the README's rule for a deadline: the latest submission before it
    bash(f"nbgrader collect --update --before-duedate {LAB}", course, env)
    bobs = nbformat.read(course / "submitted" / "bob" / LAB / f"{LAB}.ipynb", as_version=4)
    task1 = next(c for c in bobs.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "task1_gemm_flops")
    assert task1.source == stubs["task1_gemm_flops"], "collect --before-duedate took bob's late submission"

    report = {step: round(seconds, 1) for step, seconds in timings.items()}
    print("hub round trip, seconds:", json.dumps(report, indent=1))
    shutil.copy(hub["log"], course / "make_hub.log")


def test_a_learner_signs_in_and_opens_the_lab_in_jupyterlab_through_the_hub(hub):
    """In Chromium: alice signs in on the hub's page with her password, lands in her own JupyterLab
    (served through the proxy from her sandbox), and the lab she fetched opens with a kernel."""
    from selenium.webdriver.common.by import By

    assert Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists(), "make test installs Chromium and its driver"
    url, folder = hub["url"], hub["folder"]
    password = dict(csv.reader((folder / "passwords.csv").read_text().splitlines()[1:]))["alice"]
    if not (folder / "homes" / "alice" / LAB / f"{LAB}.ipynb").is_file():  # run alone: release and fetch it first
        bash(readme_blocks()[1], hub["course"], hub["env"])
        server = Server(url, hub["admin"], "alice")
        server.start(hub["admin"])
        assert server.shell(f"nbgrader fetch_assignment {LAB}")["rc"] == 0
    SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + 240  # a guard against a hang, not a speed

    def until(what, condition):
        while time.monotonic() < deadline:
            found = condition()
            if found:
                return found
            time.sleep(0.25)
        raise AssertionError(f"timed out waiting for {what} (screenshot: {SCREENSHOT})")

    driver = headless_chromium()
    try:
        driver.get(f"{url}/hub/login")
        until("the hub's sign-in page", lambda: driver.find_elements(By.ID, "username_input"))
        driver.find_element(By.ID, "username_input").send_keys("alice")
        driver.find_element(By.ID, "password_input").send_keys(password)
        driver.find_element(By.ID, "login_submit").click()
        until("alice's JupyterLab", lambda: "/user/alice/lab" in driver.current_url)
        driver.get(f"{url}/user/alice/lab/tree/{LAB}/{LAB}.ipynb")
        css = lambda selector: driver.find_elements(By.CSS_SELECTOR, selector)  # noqa: E731
        until("the lab's first cell", lambda: css(".jp-NotebookPanel .jp-Cell"))
        until(
            "the kernel to start",
            lambda: (
                css(".jp-Notebook-ExecutionIndicator[data-status='idle']")
                and "| Idle" in driver.find_element(By.ID, "jp-main-statusbar").text
            ),
        )
        until(
            "the lab's title",
            lambda: "Lab 01: GEMM profiling" in driver.find_element(By.CSS_SELECTOR, ".jp-NotebookPanel").text,
        )
    finally:
        driver.save_screenshot(str(SCREENSHOT))
        driver.quit()


def test_a_roster_the_hub_cannot_use_is_refused_with_what_to_fix(tmp_path):
    from course_tools.hub import DEMO_LEARNERS, HubError, roster_learners

    assert roster_learners(None) == list(DEMO_LEARNERS)
    roster = tmp_path / "roster.csv"
    roster.write_text("learner,canvas_id\nalice,1001\nBob Smith,1002\ninstructor,1003\n", encoding="utf-8")
    with pytest.raises(HubError, match=r"'Bob Smith', 'instructor'"):
        roster_learners(roster)
    with pytest.raises(HubError, match="no roster at"):
        roster_learners(tmp_path / "missing.txt")
    roster.write_text("# nobody yet\n", encoding="utf-8")
    with pytest.raises(HubError, match="lists no learner"):
        roster_learners(roster)


def test_feedback_is_placed_for_collected_submissions_and_says_who_was_left_out(tmp_path):
    from course_tools.classroom import place_feedback

    grades, submitted, out = tmp_path / "grades", tmp_path / "submitted", tmp_path / "feedback"
    with pytest.raises(FileNotFoundError, match="grade the lab first"):
        place_feedback(LAB, grades, submitted, out)
    for learner in ("alice", "bob"):
        (grades / learner).mkdir(parents=True)
        (grades / learner / "feedback.html").write_text(f"<p>{learner}</p>", encoding="utf-8")
    (submitted / "alice" / LAB).mkdir(parents=True)
    (submitted / "alice" / LAB / "timestamp.txt").write_text("2026-12-07 01:00:00 UTC", encoding="utf-8")
    (submitted / "alice" / LAB / "submission_secret.txt").write_text("s3cret", encoding="utf-8")
    (submitted / "bob" / LAB).mkdir(parents=True)  # graded from a folder, never collected
    placed, skipped = place_feedback(LAB, grades, submitted, out)
    assert placed == ["alice"] and len(skipped) == 1, skipped
    assert skipped[0].startswith("bob: ") and "timestamp.txt" in skipped[0]
    assert (out / "alice" / LAB / f"{LAB}.html").read_text() == "<p>alice</p>"
    assert (out / "alice" / LAB / "submission_secret.txt").read_text() == "s3cret"
