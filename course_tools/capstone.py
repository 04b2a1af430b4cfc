"""The capstone's build: a learner's engine pieces taken from their lab notebooks.

``infra-lab capstone build`` reads the answer cells of labs 06-09 exactly as the grader does (the
trusted notebook spliced with the learner's answer cells, nothing else of the learner's notebook;
the static scan applied), and writes them, one function per lab, into

* ``build/capstone/learner_engine.py``: the module ``infra-lab serve --engine learner`` imports
  (each lab's answers in a function of their own, so that two labs' helpers of the same name
  cannot collide; tracebacks point at real lines of a real file);
* the capstone lab notebook's answer cells (``labs/lab16_capstone/lab16_capstone.ipynb``), which
  the course's grader grades like any lab; the notebook's previous version is kept next to it.

A lab whose answers are the untouched stubs, or that the static scan flags, or that cannot be
compiled, gives no piece: the course's own fills in, and the report says so and why.
"""

from __future__ import annotations

import ast
import datetime
import importlib.util
import json
import shutil
import textwrap
from dataclasses import asdict, dataclass, field
from pathlib import Path

from grading.course import DEFAULT_SOURCE
from grading.notebook import (
    BEGIN_SOLUTION,
    END_SOLUTION,
    NotebookError,
    clear_solutions,
    grade_id,
    is_solution_cell,
    read_notebook,
    splice,
)
from infra_lib.serving.pieces import PIECES

CAPSTONE_LAB = "lab16_capstone"
LAB_PIECES: dict[str, tuple[str, ...]] = {}  # lab -> the pieces its answers give, in the engine's order
for _name, _piece in PIECES.items():
    LAB_PIECES[_piece.lab] = LAB_PIECES.get(_piece.lab, ()) + (_name,)
BUILD_DIR = Path("build") / "capstone"
MODULE = "learner_engine.py"
MANIFEST = "manifest.json"
STUB_BODY = "# YOUR CODE HERE"


class CapstoneError(ValueError):
    """The capstone cannot be built or loaded as asked (a missing folder, a broken build)."""


@dataclass
class LabAnswers:
    lab: str
    notebook: str  # where the answers came from ("" when there was no notebook)
    status: str  # "yours", "not started", "no notebook", "flagged", "syntax error", "unreadable"
    reason: str = ""
    source: str = ""  # the function that holds the lab's answers (empty when the course's pieces are used)
    grade: str = ""  # the lab's last recorded grade, in words ("lab08 10/13, failing: lab08 task 3: ...")
    imports: list[str] = field(default_factory=list)  # setup imports that go outside the lab's function


def grade_note(lab: str, grades_dir: str | Path, notebook: str | Path | None = None) -> str:
    """The lab's last recorded grade in ``grades_dir`` (what ``infra-lab grade`` wrote) in a few words:
    its score, the tasks still failing, and whether the answers changed since (when ``notebook`` is given).
    """
    from grading.progress import STAMP, answers_digest, read_recorded
    from grading.registry import get_check

    short = lab.split("_")[0]
    recorded = read_recorded(lab, grades_dir)
    if recorded is None:
        return f"{short} not graded yet"
    if not recorded.graded:
        return f"{short}: {recorded.note}"
    text = f"{short} {recorded.score:g}/{recorded.max_score:g}"
    tasks = []
    for failing in recorded.failing:
        try:
            task = get_check(failing.check_id).task
        except KeyError:
            task = failing.check_id
        if task not in tasks:
            tasks.append(task)
    if tasks:
        text += ", failing " + "; ".join(t.split(": ", 1)[-1] for t in tasks[:3]) + ("; ..." if len(tasks) > 3 else "")
    stamp = Path(grades_dir) / lab / STAMP
    if notebook and Path(notebook).is_file():
        try:
            current = answers_digest(Path(notebook), lab_id=lab)
        except Exception:  # noqa: BLE001 - an unreadable notebook: the extraction says why
            current = None
        if current is not None and (not stamp.is_file() or stamp.read_text().strip() != current):
            text += " (graded before your last change: grade it again)"
    return text


def setup_imports(trusted, lab: str) -> tuple[list[str], list[str]]:
    """The trusted notebook's setup imports (``import torch`` ...), less the grader's own, split in two: those
    the lab's static scan accepts in an answer (they go inside the lab's function, which the capstone's grader
    scans as an answer cell), and those it refuses (a setup cell may import from a package that holds the
    lab's reference, to give its answers the classes they use): those go outside the function, at the top of
    ``learner_engine.py`` and in the capstone notebook's own setup cell."""
    from grading import tamper
    from grading.registry import shortcut_modules

    modules, names = shortcut_modules(lab)
    inside, outside = [], []
    for cell in trusted.cells:
        if cell.get("cell_type") != "code" or grade_id(cell) != "setup":
            continue
        for node in ast.parse(cell.source).body:
            if isinstance(node, ast.Import):
                kept = [a for a in node.names if a.name.split(".")[0] != "grading"]
                line = ast.unparse(ast.Import(names=kept)) if kept else ""
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] != "grading":
                line = ast.unparse(node)
            else:
                continue
            if line:
                (outside if tamper.scan(line, modules, names, set()) else inside).append(line)
    return inside, outside


def outside_imports(source_dir: Path = DEFAULT_SOURCE) -> list[str]:
    """Every lab's setup imports that cannot sit inside its function (``setup_imports``), in lab order, once
    each: what the capstone notebook's setup cell must import for the labs' functions to run."""
    lines = []
    for lab in LAB_PIECES:
        trusted = read_notebook(Path(source_dir) / lab / f"{lab}.ipynb")
        lines += [line for line in setup_imports(trusted, lab)[1] if line not in lines]
    return lines


def defined_names(code: str) -> set[str]:
    """The names an answer cell defines at its top level (functions, classes, assignments, imports)."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return set()
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def lab_function(lab: str, prelude: list[str], answers: list[tuple[str, str]]) -> str:
    """``def <lab>(): <imports> <answer cells> return {piece: name}`` as source: the pieces the answer
    cells define (a notebook from before a piece was part of its lab gives the others)."""
    body = [f"# {lab}'s answer cells, as the grader reads them", *prelude]
    defined = set()
    for gid, code in answers:
        body += ["", f"# --- answer cell {gid}", *code.rstrip().splitlines()]
        defined |= defined_names(code)
    pieces = ", ".join(f'"{p}": {p}' for p in LAB_PIECES[lab] if p in defined)
    body += ["", f"return {{{pieces}}}"]
    return f"def {lab}():\n" + textwrap.indent("\n".join(body), "    ", lambda line: bool(line.strip())) + "\n"


def _without_markers(source: str) -> str:
    """An instructor's answer as code: the solution markers' lines dropped (the code between stays)."""
    return "\n".join(line for line in source.splitlines() if line.strip() not in (BEGIN_SOLUTION, END_SOLUTION))


def extract_lab(lab: str, labs_dir: Path, source_dir: Path = DEFAULT_SOURCE) -> LabAnswers:
    """One lab's answers from ``labs_dir/<lab>/<lab>.ipynb`` (spliced, scanned, compiled)."""
    from grading.grader import scan_answers

    path = Path(labs_dir) / lab / f"{lab}.ipynb"
    if not path.is_file():
        return LabAnswers(lab, "", "no notebook", f"no notebook at {path}")
    trusted = read_notebook(Path(source_dir) / lab / f"{lab}.ipynb")
    try:
        learner = read_notebook(path)
    except NotebookError as exc:
        return LabAnswers(lab, str(path), "unreadable", str(exc))
    spliced = splice(trusted, learner)
    written = [
        gid
        for gid, i in spliced.answers.items()
        if spliced.notebook.cells[i].source.strip() != clear_solutions(spliced.trusted_sources[gid]).strip()
    ]
    if not written:
        return LabAnswers(lab, str(path), "not started", "every answer cell is the untouched stub")
    findings = scan_answers(spliced, lab)
    if findings:
        gid, finding = next(iter(findings.items()))
        return LabAnswers(
            lab, str(path), "flagged", f"answer cell {gid!r}: {finding.kind}: {finding.detail} (line {finding.line})"
        )
    answers = [
        (gid, _without_markers(spliced.notebook.cells[i].source))
        for gid, i in sorted(spliced.answers.items(), key=lambda item: item[1])
    ]
    inside, outside = setup_imports(trusted, lab)
    source = lab_function(lab, inside, answers)
    try:
        compile(source, f"<{lab}>", "exec")
    except SyntaxError as exc:
        return LabAnswers(lab, str(path), "syntax error", f"{exc.msg} (line {exc.lineno} of the generated function)")
    return LabAnswers(lab, str(path), "yours", source=source, imports=outside)


def module_source(labs: list[LabAnswers], when: str) -> str:
    head = (
        f'"""Your engine\'s pieces, taken from your lab notebooks by `infra-lab capstone build` ({when}).\n\n'
        "Generated: change your lab notebooks (or the capstone notebook) and build again; edits here are\n"
        'overwritten. Each function returns the pieces its lab\'s answers define."""\n'
    )
    imports = list(dict.fromkeys(line for a in labs if a.status == "yours" for line in a.imports))
    parts = [head + "\n".join(imports), f"LABS = {json.dumps({a.lab: a.status for a in labs}, indent=4)}\n"]
    parts += [a.source for a in labs if a.status == "yours"]
    return "\n\n".join(parts)


def build(
    labs_dir: str | Path = "labs",
    out_dir: str | Path = BUILD_DIR,
    source_dir: Path = DEFAULT_SOURCE,
    notebook: str | Path | None = None,
    fill_notebook: bool = True,
    grades_dir: str | Path = "grades",
) -> list[LabAnswers]:
    """Extract every lab's answers, write the module and the manifest into ``out_dir``, and (with
    ``fill_notebook``) the answers into the capstone notebook (default
    ``labs_dir/lab16_capstone/lab16_capstone.ipynb``, when it exists). Each lab's last grade is read from
    ``grades_dir`` (where ``infra-lab grade`` writes it) for the report."""
    labs_dir, out_dir = Path(labs_dir), Path(out_dir)
    if not labs_dir.is_dir():
        raise CapstoneError(f"no folder {labs_dir}: pass --labs with the folder that holds your lab notebooks")
    labs = [extract_lab(lab, labs_dir, source_dir) for lab in LAB_PIECES]
    for answers in labs:
        answers.grade = grade_note(answers.lab, grades_dir, answers.notebook or None)
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MODULE).write_text(module_source(labs, when), encoding="utf-8")
    manifest = {"built": when, "labs_dir": str(labs_dir), "labs": [asdict(a) | {"source": ""} for a in labs]}
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    target = Path(notebook) if notebook else labs_dir / CAPSTONE_LAB / f"{CAPSTONE_LAB}.ipynb"
    if fill_notebook and target.is_file():
        write_answers(target, labs)
    return labs


def stub_line(lab: str) -> str:
    """The capstone stub's last line for ``lab``: the lab's task, not started."""
    number = list(LAB_PIECES).index(lab) + 1
    return f'raise NotImplementedError("lab16 task {number}: {lab}")'


def answer_cell_source(lab: str, answers: LabAnswers | None, *, markers: bool = False) -> str:
    """The capstone notebook's answer cell for ``lab``: the lab's function, or the stub."""
    doc = f'    """Your {lab} answers: `infra-lab capstone build` copies them here from your lab notebook."""\n'
    if answers is None or answers.status != "yours":
        return f"def {lab}() -> dict:\n{doc}    {STUB_BODY}\n    {stub_line(lab)}"
    body = answers.source.split("\n", 1)[1].rstrip()
    if markers:
        return f"def {lab}() -> dict:\n{doc}    {BEGIN_SOLUTION}\n{body}\n    {END_SOLUTION}\n    {stub_line(lab)}"
    return f"def {lab}() -> dict:\n{doc}{body}"


def write_answers(path: Path, labs: list[LabAnswers], *, markers: bool = False) -> None:
    """Put each lab's function into the capstone notebook's answer cell of that lab's id (the old
    notebook is kept as ``<name>.before-build.ipynb``; nothing else in it changes)."""
    import nbformat

    nb = read_notebook(path)
    by_lab = {a.lab: a for a in labs}
    found = set()
    for cell in nb.cells:
        if is_solution_cell(cell) and grade_id(cell) in LAB_PIECES:
            cell.source = answer_cell_source(grade_id(cell), by_lab.get(grade_id(cell)), markers=markers)
            found.add(grade_id(cell))
    if not found:
        raise CapstoneError(
            f"{path} has no answer cells named after the labs {sorted(LAB_PIECES)}: is it the capstone notebook?"
        )
    if not markers:
        shutil.copyfile(path, path.with_name(path.stem + ".before-build.ipynb"))
    nbformat.write(nb, str(path))


# --- loading the build: the pieces, with the course's filling in ---------------------------------------


@dataclass
class PieceRow:
    piece: str
    lab: str
    owner: str  # "yours" or "course"
    why: str  # for the course's: why yours is not used
    grade: str = ""  # the lab's last grade, in words


def pieces_from_functions(
    functions: dict, statuses: dict[str, tuple[str, str]], grades: dict[str, str] | None = None
) -> tuple[dict, list[PieceRow]]:
    """Call each lab's function (a name -> callable mapping), probe its pieces; the pieces dict for
    ``infra_lib.serving.pieces.assemble`` and one row per piece saying whose it is, why, and its lab's
    last grade (``grades``: lab -> words)."""
    grades = grades or {}
    from infra_lib.serving.pieces import probe

    pieces, rows = {}, []
    for lab, names in LAB_PIECES.items():
        status, reason = statuses.get(lab, ("not started", ""))
        got, why, grade = {}, "", grades.get(lab, "")
        if status == "yours" and lab in functions:
            try:
                got = functions[lab]() or {}
            except Exception as exc:  # noqa: BLE001 - the learner's code: report it, use the course's
                why = f"running {lab}'s answers raised {type(exc).__name__}: {exc}"
            if not isinstance(got, dict):
                got, why = {}, f"{lab}() returned a {type(got).__name__}, not a dict of pieces"
        else:
            why = {"not started": f"{lab}: not started", "no notebook": reason}.get(status, f"{status}: {reason}")
        for name in names:
            piece = got.get(name)
            if piece is None:
                rows.append(PieceRow(name, lab, "course", why or f"{lab}'s answers define no {name}", grade))
                continue
            missing = probe(name, piece)
            if missing:
                rows.append(PieceRow(name, lab, "course", f"not finished: {missing}", grade))
                continue
            pieces[name] = piece
            rows.append(PieceRow(name, lab, "yours", "", grade))
    return pieces, rows


def load(out_dir: str | Path = BUILD_DIR) -> tuple[dict, list[PieceRow]]:
    """The pieces of a build (``infra-lab capstone build``'s output folder)."""
    out_dir = Path(out_dir)
    module_path, manifest_path = out_dir / MODULE, out_dir / MANIFEST
    if not module_path.is_file() or not manifest_path.is_file():
        raise CapstoneError(f"no capstone build in {out_dir}: run `infra-lab capstone build` first")
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    statuses = {entry["lab"]: (entry["status"], entry["reason"]) for entry in manifest["labs"]}
    grades = {entry["lab"]: entry.get("grade", "") for entry in manifest["labs"]}
    spec = importlib.util.spec_from_file_location("learner_engine", module_path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001
        raise CapstoneError(f"{module_path} does not import ({type(exc).__name__}: {exc}); build it again") from exc
    functions = {lab: getattr(module, lab) for lab in LAB_PIECES if callable(getattr(module, lab, None))}
    return pieces_from_functions(functions, statuses, grades)


def report(rows: list[PieceRow]) -> str:
    """One line per piece: whose it is, with its lab's last grade beside it ("yours, lab08 10/13, failing
    preemption"), and where it enters the engine or why the course's fills in."""
    lines = [f"{'piece':<20}{'used':<8}{'last grade':<44}where it enters / why not yours"]
    for r in rows:
        where = PIECES[r.piece].seam if r.owner == "yours" else r.why
        lines.append(f"{r.piece:<20}{r.owner:<8}{(r.grade or r.lab.split('_')[0]):<44}{where}")
    yours = sum(r.owner == "yours" for r in rows)
    lines.append(f"{yours} of {len(rows)} pieces are yours; the course's fill in for the rest")
    return "\n".join(lines)


def solution_notebook_sources(source_dir: Path = DEFAULT_SOURCE) -> dict[str, str]:
    """The capstone answer cells made from the instructor notebooks (their answers, with markers)."""
    labs = [extract_lab(lab, source_dir, source_dir) for lab in LAB_PIECES]
    return {a.lab: answer_cell_source(a.lab, a, markers=True) for a in labs}


def solution_functions(source_dir: Path = DEFAULT_SOURCE) -> dict:
    """``{lab: function}``: the capstone's lab functions made from the instructor notebooks, defined as the
    capstone notebook defines them (the labs' outside imports first, then each lab's function)."""
    namespace: dict = {}
    exec("\n".join(outside_imports(source_dir)), namespace)  # noqa: S102 (the course's own setup imports)
    for source in solution_notebook_sources(source_dir).values():
        exec(source, namespace)  # noqa: S102 (the course's own solution cells)
    return {lab: namespace[lab] for lab in LAB_PIECES}
