"""Answers that look alike, for the instructor: a signal, never a score.

Each learner's answer cells are compared with the course's solution cell, the lab's reference
functions (what ``register_shortcuts`` names) and every other learner's cell for the same task.
The comparison is on structure, not text: an answer is parsed, its docstrings dropped, every name
it binds itself (arguments, locals, its functions) replaced by its order of first appearance and
every constant by its type, then read as a pre-order sequence of syntax tokens. Renaming
variables, rewording comments, reformatting or changing numbers therefore changes nothing.

Two answers are compared by their sets of K consecutive tokens (K-grams, as MOSS does), with the
grams of the released stub (the signature and docstring every learner is given) removed first.
The score is the share of the smaller set found in the larger: 1.0 when one answer holds all of
the other, even with code added around it. Answers with fewer than ``MIN_GRAMS`` grams of their
own (``return 2 * m * n * k``) say too little to tell copying from the one obvious answer, and
are not compared.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass
from pathlib import Path

K = 5
MIN_GRAMS = 30  # about three lines of code of its own
THRESHOLD = 0.8  # flag a pair at or above this score
MAX_CHARS = 200_000  # a longer answer cell is not compared


@dataclass(frozen=True)
class Match:
    learner: str
    answer: str  # the answer cell's grade_id
    other: str  # another learner, "the course's solution" or "reference module.function"
    score: float


def tokens(source: str) -> list[str] | None:
    """The normalised token sequence of a piece of Python; None when it does not parse."""
    if len(source) > MAX_CHARS:
        return None
    try:
        tree = ast.parse(textwrap.dedent(source))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    bound: dict[str, str] = {}

    def bind(name: str) -> str:
        return bound.setdefault(name, f"v{len(bound)}")

    for node in ast.walk(tree):  # the names this code binds itself, in order of appearance
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bind(node.name)
        elif isinstance(node, ast.arg):
            bind(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bind(node.id)
    out: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.expr_context):
            return
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and _is_docstring(body[0]):
            body = body[1:]
        out.append(type(node).__name__)
        if isinstance(node, ast.Name):
            out.append(bound.get(node.id, node.id))
        elif isinstance(node, ast.arg):
            out.append(bound[node.arg])
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.append(bound[node.name])
        elif isinstance(node, ast.Attribute):
            out.append("." + node.attr)
        elif isinstance(node, ast.Constant):
            out.append(type(node.value).__name__)
        for name, value in ast.iter_fields(node):
            if name == "body" and isinstance(body, list):
                value = body
            if name in ("type_comment", "annotation", "returns"):
                continue  # annotations come from the stub or are style
            for child in value if isinstance(value, list) else [value]:
                if isinstance(child, ast.AST):
                    visit(child)

    try:
        visit(tree)
    except RecursionError:  # nested past what a lab answer needs: nothing to compare
        return None
    return out


def _is_docstring(statement: ast.stmt) -> bool:
    return (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)
            and isinstance(statement.value.value, str))


def grams(source: str, base: frozenset[tuple[str, ...]] = frozenset()) -> frozenset[tuple[str, ...]] | None:
    """The K-grams of ``source``'s tokens, less those in ``base``; None when it does not parse."""
    seq = tokens(source)
    if seq is None:
        return None
    return frozenset(tuple(seq[i:i + K]) for i in range(len(seq) - K + 1)) - base


def score(a: frozenset, b: frozenset) -> float | None:
    """The share of the smaller set found in the larger; None when either is too small to say."""
    if len(a) < MIN_GRAMS or len(b) < MIN_GRAMS:
        return None
    return len(a & b) / min(len(a), len(b))


def _reference_sources(lab_id: str) -> dict[str, str]:
    from grading.registry import shortcut_functions

    sources = {}
    for fn in shortcut_functions(lab_id):
        try:
            sources[f"reference {fn.__module__}.{fn.__qualname__}"] = inspect.getsource(fn)
        except (OSError, TypeError):
            continue
    return sources


def compare_class(answers: dict[str, dict[str, str]], solution: dict[str, str], stubs: dict[str, str],
                  references: dict[str, str], threshold: float = THRESHOLD) -> list[Match]:
    """Close matches, highest first.

    Args:
        answers: learner -> answer grade_id -> the learner's source.
        solution: grade_id -> the course's solution source.
        stubs: grade_id -> the released stub (its grams are everyone's and are not counted).
        references: name -> source of a reference function (compared with every answer cell).
    """
    matches: list[Match] = []
    base = {gid: grams(stub) or frozenset() for gid, stub in stubs.items()}
    reference_grams = {name: grams(source) for name, source in references.items()}
    for gid in stubs:
        prints = {learner: grams(cells[gid], base[gid]) for learner, cells in answers.items() if gid in cells}
        prints = {learner: p for learner, p in prints.items() if p}
        known = {"the course's solution": grams(solution.get(gid, ""), base[gid]),
                 **{name: p for name, p in reference_grams.items()}}
        learners = sorted(prints)
        for i, learner in enumerate(learners):
            for other, theirs in known.items():
                s = score(prints[learner], theirs) if theirs else None
                if s is not None and s >= threshold:
                    matches.append(Match(learner, gid, other, s))
            for peer in learners[i + 1:]:
                s = score(prints[learner], prints[peer])
                if s is not None and s >= threshold:
                    matches.append(Match(learner, gid, peer, s))
                    matches.append(Match(peer, gid, learner, s))
    return sorted(matches, key=lambda m: (-m.score, m.learner, m.answer, m.other))


def class_matches(notebooks: dict[str, Path], lab_id: str, source_dir: Path,
                  threshold: float = THRESHOLD) -> list[Match]:
    """Close matches among a class's notebooks (learner -> notebook) for one lab; an unreadable
    notebook is left out (its grading says why)."""
    from grading.notebook import NotebookError, clear_solutions, grade_id, is_solution_cell, read_notebook, splice

    trusted = read_notebook(Path(source_dir) / lab_id / f"{lab_id}.ipynb")
    solution = {grade_id(c): c.source for c in trusted.cells if is_solution_cell(c)}
    stubs = {gid: clear_solutions(source) for gid, source in solution.items()}
    answers: dict[str, dict[str, str]] = {}
    for learner, path in notebooks.items():
        try:
            spliced = splice(trusted, read_notebook(path))
        except (NotebookError, OSError):
            continue
        answers[learner] = {gid: spliced.notebook.cells[index].source for gid, index in spliced.answers.items()}
    return compare_class(answers, solution, stubs, _reference_sources(lab_id), threshold)


def flags(matches: list[Match]) -> dict[str, str]:
    """learner -> one line for the scores table ("task2_time_op: bob 0.97, the course's solution 0.85; ...")."""
    grouped: dict[str, dict[str, list[str]]] = {}
    for m in matches:
        grouped.setdefault(m.learner, {}).setdefault(m.answer, []).append(f"{m.other} {m.score:.2f}")
    return {learner: "; ".join(f"{answer}: {', '.join(others)}" for answer, others in sorted(answers.items()))
            for learner, answers in grouped.items()}


def report(matches: list[Match], lab_id: str, learners: int) -> str:
    """The similarity report, as Markdown."""
    lines = [f"# Similar answers: {lab_id}", "",
             f"{learners} learners' answer cells compared with the course's solution, the lab's reference "
             f"functions and each other, on their structure (names, constants, comments and layout do not "
             f"count). A score is the share of the smaller answer found in the larger; pairs at "
             f"{THRESHOLD:.2f} or more are listed. This is a signal to look at, not a verdict: short answers "
             f"are not compared, and two learners can reach the same code honestly.", ""]
    if not matches:
        return "\n".join(lines + ["No close matches."]) + "\n"
    lines += ["| learner | answer | close to | score |", "|---|---|---|---|"]
    lines += [f"| {m.learner} | {m.answer} | {m.other} | {m.score:.2f} |" for m in matches]
    return "\n".join(lines) + "\n"
