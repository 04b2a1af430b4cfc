"""The ``infra-lab`` command: doctor, grade, progress, site, release, serve."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_USAGE = 2


def _cmd_doctor(args) -> int:
    from grading.doctor import findings, report

    text, code = report(findings(run_triton=not args.skip_triton))
    print(text)
    return code


def _limits(args):
    from grading.sandbox import Limits

    return Limits(cell_timeout=args.cell_timeout, check_timeout=args.check_timeout, budget=args.budget,
                  memory_mb=args.memory_mb, max_processes=args.max_processes, file_size_mb=args.file_size_mb,
                  output_kb=args.output_kb, isolate_network=not args.allow_network)


def _cmd_grade(args) -> int:
    if args.submissions is not None:
        return _cmd_grade_batch(args)
    if args.notebook is None:
        print("infra-lab grade: give a notebook, or --submissions DIR --lab LAB for a class", file=sys.stderr)
        return EXIT_USAGE
    from grading.grader import GradingError, grade_notebook
    from grading.report import table, write_reports

    out_dir = Path(args.out) if args.out else Path("grades") / (args.lab or args.notebook.stem)
    try:
        limits = _limits(args)
        print(f"grading {args.notebook} (a fresh kernel runs the lab; about 10-30 s)...", file=sys.stderr, flush=True)
        report = grade_notebook(args.notebook, lab_id=args.lab, source_dir=args.source, seed=args.seed, limits=limits)
    except (GradingError, ValueError) as exc:
        _write_failure(out_dir, str(exc))
        print(f"infra-lab grade: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:  # the grader must always leave a results.json behind
        _write_failure(out_dir, f"internal grader error: {type(exc).__name__}: {exc}")
        print(f"infra-lab grade: internal error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_PROBLEM
    out_dir = Path(args.out) if args.out else Path("grades") / report.lab_id
    written = write_reports(report, out_dir)
    print(table(report))
    print(f"\nwrote {', '.join(str(p) for p in written)}")
    return EXIT_OK


def _write_failure(out_dir: Path, message: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {"score": 0.0, "max_score": 0.0, "output": message, "tests": []}
    (out_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")


def _cmd_grade_batch(args) -> int:
    from grading.batch import grade_batch

    if not args.lab:
        print("infra-lab grade --submissions needs --lab LAB_ID", file=sys.stderr)
        return EXIT_USAGE
    out_dir = Path(args.out) if args.out else Path("grades") / args.lab
    try:
        rows = grade_batch(args.submissions, args.lab, out_dir, source_dir=args.source, limits=_limits(args),
                           workers=args.workers, seed=args.seed)
    except (FileNotFoundError, ValueError) as exc:
        print(f"infra-lab grade: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if not rows:
        print(f"infra-lab grade: no notebooks found in {args.submissions}", file=sys.stderr)
        return EXIT_USAGE
    width = max(len(r.learner) for r in rows)
    for row in rows:
        print(f"{row.learner.ljust(width)}  {row.score:g}/{row.max_score:g}  {row.status}  {row.note}".rstrip())
    graded = sum(r.status == "graded" for r in rows)
    cached = sum(r.status == "cached" for r in rows)
    failed = sum(r.status == "failed" for r in rows)
    print(f"\n{len(rows)} learners: {graded} graded, {cached} unchanged (cached), {failed} failed; "
          f"scores in {out_dir / 'scores.csv'}")
    return EXIT_OK


def _cmd_progress(args) -> int:
    from grading.progress import course_progress, find_labs, progress_table, write_chart

    labs = [Path(p) for p in args.notebooks] if args.notebooks else find_labs(args.labs)
    if not labs:
        print(f"infra-lab progress: no labs found under {args.labs}", file=sys.stderr)
        return EXIT_USAGE
    rows = course_progress(labs, args.out, limits=_limits(args), regrade=args.regrade)
    print(progress_table(rows))
    print(f"\nfeedback for each lab: {args.out}/<lab>/feedback.md")
    if not args.no_chart:
        chart = write_chart(rows, args.chart or Path(args.out) / "progress.html")
        print(f"chart: {chart} (open it in a browser; hover a bar for the failing checks)")
    return EXIT_OK


def _cmd_site(args) -> int:
    from grading.site import build_site

    only = set(args.only.split(",")) if args.only else None
    try:
        lessons, failures = build_site(args.notebooks, args.out, only=only, execute=not args.no_execute)
    except ValueError as exc:
        print(f"infra-lab site: {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(f"wrote {len(lessons)} pages and the contents: {Path(args.out) / 'index.html'}")
    if failures:
        print(f"\n{len(failures)} lesson(s) failed; their pages show the run up to the error:")
        for failure in failures:
            print(f"  {failure.describe()}")
        return EXIT_PROBLEM
    return EXIT_OK


def _cmd_release(args) -> int:
    from grading.release import generate, lab_ids

    for lab_id in args.lab or lab_ids():
        target = generate(lab_id, Path(args.out))
        print(f"generated {target}")
    return EXIT_OK


def _add_limit_options(parser: argparse.ArgumentParser) -> None:
    from grading.sandbox import Limits

    d = Limits()
    group = parser.add_argument_group("limits on the learner's kernel")
    group.add_argument("--check-timeout", type=float, default=d.check_timeout, help=f"seconds per check ({d.check_timeout:g})")
    group.add_argument("--cell-timeout", type=float, default=d.cell_timeout, help=f"seconds per cell ({d.cell_timeout:g})")
    group.add_argument("--budget", type=float, default=d.budget, help=f"seconds per notebook ({d.budget:g})")
    group.add_argument("--memory-mb", type=int, default=d.memory_mb, help=f"address space in MiB ({d.memory_mb})")
    group.add_argument("--max-processes", type=int, default=d.max_processes, help=f"live processes ({d.max_processes})")
    group.add_argument("--file-size-mb", type=int, default=d.file_size_mb, help=f"largest file in MiB ({d.file_size_mb})")
    group.add_argument("--output-kb", type=int, default=d.output_kb, help=f"output kept per cell in KiB ({d.output_kb})")
    group.add_argument("--allow-network", action="store_true", help="do not isolate the kernel from the network")


def build_parser() -> argparse.ArgumentParser:
    from grading.grader import DEFAULT_SOURCE
    from grading.release import REPO_ROOT

    parser = argparse.ArgumentParser(prog="infra-lab", description="The course's command line.")
    sub = parser.add_subparsers(dest="command", required=True)

    doctor = sub.add_parser("doctor", help="check the environment and say how to fix problems")
    doctor.add_argument("--skip-triton", action="store_true", help="skip the Triton interpreter kernel")
    doctor.set_defaults(func=_cmd_doctor)

    grade = sub.add_parser("grade", help="grade one lab notebook, or a class with --submissions")
    grade.add_argument("notebook", type=Path, nargs="?", help="the lab notebook, e.g. labs/lab01_gemm/lab01_gemm.ipynb")
    grade.add_argument("--submissions", type=Path, help="a folder with one notebook (or folder) per learner")
    grade.add_argument("--workers", type=int, help="parallel grading processes for --submissions (default: cores/2)")
    grade.add_argument("--out", help="folder for the reports (default grades/<lab>)")
    grade.add_argument("--lab", help="lab id, when the file name does not say it (required with --submissions)")
    grade.add_argument("--source", type=Path, default=DEFAULT_SOURCE, help="instructor notebooks (default solutions/)")
    grade.add_argument("--seed", type=int, help="grade-time seed (default: random)")
    _add_limit_options(grade)
    grade.set_defaults(func=_cmd_grade)

    progress = sub.add_parser("progress", help="grade every lab (unchanged ones only once) and show a table and a chart")
    progress.add_argument("notebooks", nargs="*", help="lab notebooks to grade (default: every lab in --labs)")
    progress.add_argument("--labs", default=str(REPO_ROOT / "labs"), help="folder of labs (default labs/)")
    progress.add_argument("--out", default="grades", help="where each lab's reports go (default grades/)")
    progress.add_argument("--regrade", action="store_true", help="grade even labs unchanged since last time")
    progress.add_argument("--chart", help="the chart's HTML file (default <out>/progress.html)")
    progress.add_argument("--no-chart", action="store_true", help="do not write the chart")
    _add_limit_options(progress)
    progress.set_defaults(func=_cmd_progress)

    site = sub.add_parser("site", help="run every lesson (QUICK) and render the course as a static web site")
    site.add_argument("--only", help="comma-separated chapter numbers, e.g. 00,12 (default: every lesson)")
    site.add_argument("--no-execute", action="store_true", help="render the notebooks as they are, without running them")
    site.add_argument("--out", default=str(REPO_ROOT / "site"), help="the site folder (default site/)")
    site.add_argument("--notebooks", default=str(REPO_ROOT / "notebooks"), help="the lessons (default notebooks/)")
    site.set_defaults(func=_cmd_site)

    release = sub.add_parser("release", help="regenerate labs/ from solutions/ with nbgrader")
    release.add_argument("lab", nargs="*", help="lab ids (default: all)")
    release.add_argument("--out", default=str(REPO_ROOT / "labs"), help="release folder (default labs/)")
    release.set_defaults(func=_cmd_release)

    serve = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API on 127.0.0.1")
    from infra_lib.serving.server import add_serve_arguments, serve_main
    add_serve_arguments(serve)
    serve.set_defaults(func=serve_main)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
