"""The ``infra-lab`` command: doctor, grade, progress, release."""

from __future__ import annotations

import argparse
import hashlib
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


def _answers_digest(path: Path) -> str:
    """A digest of what grading depends on: the learner's answer cells and the trusted source."""
    from grading.grader import trusted_source
    from grading.notebook import grade_id, is_solution_cell, read_notebook

    digest = hashlib.sha256()
    for cell in read_notebook(path).cells:
        if is_solution_cell(cell):
            digest.update(f"{grade_id(cell)}\0{cell.source}\0".encode())
    digest.update(trusted_source(path)[1].read_bytes())
    return digest.hexdigest()


def _cmd_progress(args) -> int:
    from grading.grader import GradingError, grade_notebook
    from grading.notebook import NotebookError
    from grading.report import gradescope_results, write_reports

    labs = sorted(Path(args.labs).glob("*/*.ipynb"))
    labs = [p for p in labs if p.stem == p.parent.name]
    if not labs:
        print(f"infra-lab progress: no labs found under {args.labs}", file=sys.stderr)
        return EXIT_USAGE
    rows = [("lab", "score", "tests passed", "")]
    total = maximum = 0.0
    for path in labs:
        out_dir = Path(args.out) / path.stem
        cache = out_dir / "results.json"
        stamp = out_dir / "graded-answers.sha256"
        try:
            digest = _answers_digest(path)
            if cache.exists() and stamp.exists() and stamp.read_text() == digest and not args.regrade:
                results, note = json.loads(cache.read_text()), "(unchanged since last grade)"
            else:
                print(f"grading {path}...", file=sys.stderr, flush=True)
                report = grade_notebook(path, limits=_limits(args))
                write_reports(report, out_dir)
                stamp.write_text(digest)
                results, note = gradescope_results(report), ""
        except (GradingError, NotebookError) as exc:
            rows.append((path.stem, "-", "-", f"cannot grade: {exc}"))
            continue
        passed = sum(t["status"] == "passed" for t in results["tests"])
        total, maximum = total + results["score"], maximum + results["max_score"]
        rows.append((path.stem, f"{results['score']:g}/{results['max_score']:g}",
                     f"{passed}/{len(results['tests'])}", note))
    rows.append(("total", f"{total:g}/{maximum:g}", "", ""))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for i, row in enumerate(rows):
        if i in (1, len(rows) - 1):
            print("  ".join("-" * w for w in widths[:3]))
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    print(f"\nfeedback for each lab: {args.out}/<lab>/feedback.md")
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

    progress = sub.add_parser("progress", help="grade every lab and show a table")
    progress.add_argument("--labs", default=str(REPO_ROOT / "labs"), help="folder of labs (default labs/)")
    progress.add_argument("--out", default="grades", help="where each lab's reports go (default grades/)")
    progress.add_argument("--regrade", action="store_true", help="grade even labs unchanged since last time")
    _add_limit_options(progress)
    progress.set_defaults(func=_cmd_progress)

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
