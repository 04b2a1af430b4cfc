"""Answers that look alike, for the instructor: a signal, never a score.

Each learner's answer cells are compared with the course's solution cell, the lab's reference
functions (what ``register_shortcuts`` names), the grader's own course-side code (the functions of
``grading/checks/*.py``) and every other learner's cell for the same task.

The comparison is on structure, not text, and function by function. A source is parsed and cut
into units: each function and method, and the statements outside any function. A unit is read as
a pre-order sequence of syntax tokens with its docstrings and annotations dropped, every constant
replaced by its type, every name the unit binds itself (parameters, locals, loop variables)
replaced by its order of first appearance *within its statement*, every name bound by an import
by the name it imports, and every call of another function of the same source by one token. So
renaming a parameter or a helper, rewording comments, reformatting, changing numbers or moving an
import changes nothing; numbering within the statement rather than the function keeps a helper's
lines the same tokens when they are pasted into their caller.

Each unit is fingerprinted by its sets of K consecutive tokens (K-grams, as MOSS does), together
with those of every function of the same source it calls, directly or not: a helper split out of a
function, or one inlined into it, leaves the caller's fingerprint as it was. The grams of the
released stub (the signature, docstring and given helpers every learner is given) are removed
first. Two units score the share of the smaller fingerprint found in the larger (1.0 when one
holds all of the other, even with code added around it); two sources score their best pair of
units, whatever order the functions stand in, and that pair is reported. An answer is judged by its
entry functions (those no other function of it calls, their helpers included): a small helper on its
own is often the one obvious way to do its part, and would match the reference's by necessity. A unit with fewer than
``MIN_GRAMS`` grams of its own (``return 2 * m * n * k``) says too little to tell copying from the
one obvious answer, and is not compared.
"""

from __future__ import annotations

import ast
import copy
import functools
import importlib
import inspect
import textwrap
from dataclasses import dataclass
from pathlib import Path

K = 5
MIN_GRAMS = 30  # about three lines of code of its own
THRESHOLD = 0.8  # flag a pair at or above this score
MAX_CHARS = 200_000  # a longer source is not compared
MODULE = "<module>"  # the unit of a source's statements outside any function
SOLUTION = "the course's solution"
CHECKS = Path(__file__).resolve().parent / "checks"  # the grader's course-side code

Grams = frozenset  # of K-tuples of tokens
# Leaving a loop or a function early is one token: a helper's bare ``return`` becomes a ``break`` when
# its body is pasted into its caller's loop.
_JUMPS = (ast.Break, ast.Continue, ast.Return)
_JUMP = "Jump"
Prints = dict  # unit name -> the unit's grams with those of the functions it calls


@dataclass(frozen=True)
class Match:
    learner: str
    answer: str  # the answer cell's grade_id
    other: str  # another learner, the course's solution, "reference module.function" or "course module.function"
    score: float
    pair: str = ""  # the matched units, "alice:schedule ~ solution:_admit"


@dataclass(frozen=True)
class _Unit:
    tokens: tuple[str, ...]
    calls: frozenset[str]  # simple names of the source's functions and methods that this unit names


def _parse(source: str) -> ast.Module | None:
    if len(source) > MAX_CHARS:
        return None
    try:
        return ast.parse(textwrap.dedent(source))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _unit_nodes(tree: ast.Module) -> dict[str, ast.AST | list[ast.stmt]]:
    """Unit name -> its function node (``name`` or ``Class.name``), or the statements outside any function."""
    units: dict[str, ast.AST | list[ast.stmt]] = {}
    loose: list[ast.stmt] = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            units[node.name] = node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    units[f"{node.name}.{item.name}"] = item
        elif not _is_docstring(node):
            loose.append(node)
    if loose:
        units[MODULE] = loose
    return units


def _own_names(nodes: list[ast.AST]) -> set[str]:
    """The names a unit binds itself (not those it declares global, nor those bound by an import)."""
    own, declared = set(), set()
    for root in nodes:
        for node in ast.walk(root):
            if isinstance(node, ast.arg):
                own.add(node.arg)
            elif isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
                own.add(node.id)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node is not root:
                own.add(node.name)
            elif isinstance(node, ast.ExceptHandler) and node.name:
                own.add(node.name)
            elif isinstance(node, (ast.Global, ast.Nonlocal)):
                declared.update(node.names)
    return own - declared


def _imported(tree: ast.Module) -> dict[str, str]:
    """Name bound by an import anywhere in the source -> the name it imports (``np`` -> ``numpy``)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                names[alias.asname or alias.name.split(".")[0]] = (
                    alias.name if alias.asname else alias.name.split(".")[0]
                )
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                names[alias.asname or alias.name] = alias.name
    return names


def _unit_tokens(unit: ast.AST | list[ast.stmt], imported: dict[str, str], helpers: set[str]) -> _Unit:
    nodes = unit if isinstance(unit, list) else [unit]
    own = _own_names(nodes)
    out: list[str] = []
    calls: set[str] = set()
    scope: dict[str, str] = {}

    def name(text: str) -> str:
        if text in own:
            return scope.setdefault(text, f"v{len(scope)}")
        if text in helpers:
            calls.add(text)
            return "FN"
        return imported.get(text, text)

    def visit(node: ast.AST) -> None:
        nonlocal scope
        if isinstance(node, (ast.expr_context, ast.alias)):
            return
        saved = scope
        if isinstance(node, ast.stmt):
            scope = {}  # names are numbered afresh in each statement
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and _is_docstring(body[0]):
            body = body[1:]
        out.append(_JUMP if isinstance(node, _JUMPS) and getattr(node, "value", None) is None else type(node).__name__)
        if isinstance(node, ast.Name):
            out.append(name(node.id))
        elif isinstance(node, ast.arg):
            out.append(name(node.arg))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.append("FN" if node in nodes else name(node.name))  # a unit's own name is no call
        elif isinstance(node, ast.Attribute):
            out.append("." + node.attr)
            if node.attr in helpers:
                calls.add(node.attr)
        elif isinstance(node, ast.Constant):
            out.append(type(node.value).__name__)
        for field, value in ast.iter_fields(node):
            if field == "body" and isinstance(body, list):
                value = body
            if field in ("type_comment", "annotation", "returns"):
                continue  # annotations come from the stub or are style
            for child in value if isinstance(value, list) else [value]:
                if isinstance(child, ast.AST):
                    visit(child)
        scope = saved

    for node in nodes:
        visit(node)
    return _Unit(tuple(out), frozenset(calls))


def _expression_helpers(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    """Module-level functions whose whole body is ``return <expression>``, with plain parameters only."""
    found = {}
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or node.decorator_list:
            continue
        body = node.body[1:] if node.body and _is_docstring(node.body[0]) else node.body
        a = node.args
        if (
            len(body) == 1
            and isinstance(body[0], ast.Return)
            and body[0].value is not None
            and not (a.vararg or a.kwarg or a.kwonlyargs or a.posonlyargs or a.defaults)
        ):
            found[node.name] = node
    return found


class _Inline(ast.NodeTransformer):
    """Replaces each call of an expression helper (positional arguments, one per parameter) by the
    helper's expression with its parameters replaced by the arguments: the code as it reads once the
    helper is pasted into its caller."""

    def __init__(self, helpers: dict[str, ast.FunctionDef]):
        self.helpers = helpers
        self.inlined: set[str] = set()
        self.depth = 0

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        helper = self.helpers.get(node.func.id) if isinstance(node.func, ast.Name) else None
        params = [a.arg for a in helper.args.args] if helper else []
        if (
            helper is None
            or node.keywords
            or len(node.args) != len(params)
            or self.depth > 8
            or any(isinstance(arg, ast.Starred) for arg in node.args)
        ):
            return node
        body = helper.body[-1].value
        values = dict(zip(params, node.args))

        class Substitute(ast.NodeTransformer):
            def visit_Name(self, name: ast.Name) -> ast.AST:
                return copy.deepcopy(values[name.id]) if name.id in values else name

        expression = Substitute().visit(copy.deepcopy(body))
        self.inlined.add(helper.name)
        self.depth += 1
        try:
            return self.visit(expression)  # a helper that calls another is inlined in turn
        finally:
            self.depth -= 1


def _inline_expression_helpers(tree: ast.Module) -> set[str]:
    """Inline every call of an expression helper in ``tree``'s other functions (in place); returns the
    helpers no longer named anywhere but in their own definition (they leave the units)."""
    helpers = _expression_helpers(tree)
    if not helpers:
        return set()
    inline = _Inline(helpers)
    for node in tree.body:
        if not (isinstance(node, ast.FunctionDef) and node.name in helpers):
            inline.visit(node)
    named = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    return {name for name in inline.inlined if name not in named}


def _units(source: str) -> dict[str, _Unit] | None:
    """The source's units, tokenised; None when it does not parse or nests too deeply to read."""
    tree = _parse(source)
    if tree is None:
        return None
    try:
        pasted = _inline_expression_helpers(tree)
    except RecursionError:
        return None
    tree.body = [node for node in tree.body if not (isinstance(node, ast.FunctionDef) and node.name in pasted)]
    nodes = _unit_nodes(tree)
    helpers = {unit.rsplit(".", 1)[-1] for unit in nodes if unit != MODULE}
    imported = _imported(tree)
    try:
        return {unit: _unit_tokens(node, imported, helpers) for unit, node in nodes.items()}
    except RecursionError:  # nested past what a lab answer needs: nothing to compare
        return None


def _is_docstring(statement: ast.stmt) -> bool:
    return (
        isinstance(statement, ast.Expr)
        and isinstance(statement.value, ast.Constant)
        and isinstance(statement.value.value, str)
    )


def _grams_of(seq: tuple[str, ...]) -> Grams:
    return frozenset(seq[i : i + K] for i in range(len(seq) - K + 1))


def tokens(source: str) -> list[str] | None:
    """The normalised tokens of a piece of Python, unit after unit; None when it does not parse."""
    units = _units(source)
    return None if units is None else [token for unit in units.values() for token in unit.tokens]


def grams(source: str, base: Grams = frozenset()) -> Grams | None:
    """The K-grams of every unit of ``source``, less those in ``base``; None when it does not parse."""
    units = _units(source)
    if units is None:
        return None
    return frozenset().union(*(_grams_of(unit.tokens) for unit in units.values())) - base


def fingerprint(source: str, base: Grams = frozenset(), entries: bool = False) -> Prints | None:
    """Unit name -> its grams with those of every function of the source it calls (transitively),
    less ``base``; None when the source does not parse.

    ``entries``: only the units no function of the source calls (its entry points, whose grams then
    hold all of its helpers'), and the statements outside any function. A helper is then judged with
    the function that uses it: a small one on its own is often the one obvious way to do its part.
    """
    units = _units(source)
    if units is None:
        return None
    called = {callee for unit, u in units.items() if unit != MODULE for callee in u.calls}
    if entries:
        kept = [unit for unit in units if unit == MODULE or unit.rsplit(".", 1)[-1] not in called]
        units_kept = set(kept) if any(unit != MODULE for unit in kept) else set(units)  # a cycle: every unit
    else:
        units_kept = set(units)
    by_name: dict[str, list[str]] = {}
    for unit in units:
        by_name.setdefault(unit.rsplit(".", 1)[-1], []).append(unit)
    own = {unit: _grams_of(u.tokens) for unit, u in units.items()}
    prints = {}
    for unit in sorted(units_kept, key=list(units).index):
        reached, todo = {unit}, [unit] if unit != MODULE else []  # module code is not its callees
        while todo:
            for callee in units[todo.pop()].calls:
                for target in by_name.get(callee, ()):
                    if target not in reached:
                        reached.add(target)
                        todo.append(target)
        prints[unit] = frozenset().union(*(own[name] for name in reached)) - base
    return prints


def score(a: Grams, b: Grams) -> float | None:
    """The share of the smaller set found in the larger; None when either is too small to say."""
    if len(a) < MIN_GRAMS or len(b) < MIN_GRAMS:
        return None
    return len(a & b) / min(len(a), len(b))


def found_in(a: Grams, b: Grams) -> float | None:
    """The share of ``a`` found in ``b``; None when either is too small to say."""
    if len(a) < MIN_GRAMS or len(b) < MIN_GRAMS:
        return None
    return len(a & b) / len(a)


def best_pair(a: Prints, b: Prints, base: Grams = frozenset(), measure=score) -> tuple[float, str, str] | None:
    """(score, unit of a, unit of b) of the closest pair of units, ``base`` removed from both; None when no
    pair is large enough to compare. ``measure``: :func:`score`, or :func:`found_in` (how much of a's unit
    stands in b's)."""
    best = None
    for unit_a, grams_a in a.items():
        grams_a = grams_a - base
        if len(grams_a) < MIN_GRAMS:
            continue
        for unit_b, grams_b in b.items():
            s = measure(grams_a, grams_b - base)
            if s is not None and (best is None or s > best[0]):
                best = (s, unit_a, unit_b)
    return best


@functools.lru_cache(maxsize=64)
def _file_prints(path: Path, mtime: float) -> Prints:
    return fingerprint(path.read_text(encoding="utf-8", errors="replace")) or {}


def file_fingerprint(path: Path) -> Prints:
    """:func:`fingerprint` of a Python file, kept while the file is unchanged."""
    path = Path(path).resolve()
    return _file_prints(path, path.stat().st_mtime)


def reference_prints(lab_id: str) -> dict[str, Prints]:
    """ "reference module.function" -> the fingerprint of one of the lab's reference functions (with the
    functions of its module it calls), for each function ``register_shortcuts`` names."""
    from grading.registry import shortcut_functions

    found = {}
    for fn in shortcut_functions(lab_id):
        try:
            path = Path(inspect.getsourcefile(importlib.import_module(fn.__module__)))
        except (OSError, TypeError):
            continue
        prints = file_fingerprint(path)
        if fn.__qualname__ in prints:
            found[f"reference {fn.__module__}.{fn.__qualname__}"] = {fn.__qualname__: prints[fn.__qualname__]}
    return found


def course_prints(folder: Path = CHECKS) -> dict[str, Prints]:
    """ "course grading.checks.<module>" -> the fingerprint of that check module (the grader's own code),
    a lab's package included module by module ("course grading.checks.lab05.ring_all_reduce")."""
    folder = Path(folder)
    return {
        "course grading.checks." + ".".join(path.relative_to(folder).with_suffix("").parts): file_fingerprint(path)
        for path in sorted(folder.rglob("*.py"))
        if "__pycache__" not in path.parts
    }


def _short(other: str) -> str:
    return (
        "solution"
        if other == SOLUTION
        else other.split(" ", 1)[0]
        if other.startswith(("reference ", "course "))
        else other
    )


def compare_class(
    answers: dict[str, dict[str, str]],
    solution: dict[str, str],
    stubs: dict[str, str],
    references: dict[str, Prints],
    threshold: float = THRESHOLD,
    course: dict[str, Prints] | None = None,
) -> list[Match]:
    """Close matches, highest first; at most one per learner, answer and other (its best pair of units:
    the answers' and the solution's entry functions, the reference function, each course function).

    Args:
        answers: learner -> answer grade_id -> the learner's source.
        solution: grade_id -> the course's solution source.
        stubs: grade_id -> the released stub (its grams are everyone's and are not counted).
        references: "reference module.function" -> its fingerprint (compared with every answer cell).
        course: "course module" -> the fingerprint of a module of the grader's own code; each of its
            functions is compared with every answer cell and named on its own.
    """
    matches: list[Match] = []
    known: dict[str, Prints] = dict(references)
    for module, prints in (course or {}).items():
        known.update({f"{module}.{unit}": {unit: grams} for unit, grams in prints.items() if unit != MODULE})

    def add(learner: str, gid: str, other: str, found: tuple[float, str, str] | None, label: str) -> None:
        if found is not None and found[0] >= threshold:
            s, mine, theirs = found
            matches.append(Match(learner, gid, other, s, f"{learner}:{mine} ~ {label}:{theirs}"))

    for gid in stubs:
        base = grams(stubs[gid]) or frozenset()
        prints = {
            learner: fingerprint(cells[gid], base, entries=True) for learner, cells in answers.items() if gid in cells
        }
        prints = {learner: p for learner, p in prints.items() if p}
        # the stub's grams leave every side once here, not once per pair compared
        others = {
            SOLUTION: fingerprint(solution.get(gid, ""), base, entries=True) or {},
            **{name: {unit: unit_grams - base for unit, unit_grams in p.items()} for name, p in known.items()},
        }
        learners = sorted(prints)
        for i, learner in enumerate(learners):
            for other, theirs in others.items():
                add(learner, gid, other, best_pair(prints[learner], theirs), _short(other))
            for peer in learners[i + 1 :]:
                found = best_pair(prints[learner], prints[peer])
                add(learner, gid, peer, found, peer)
                if found is not None:
                    add(peer, gid, learner, (found[0], found[2], found[1]), learner)
    return sorted(matches, key=lambda m: (-m.score, m.learner, m.answer, m.other))


def class_matches(
    notebooks: dict[str, Path], lab_id: str, source_dir: Path, threshold: float = THRESHOLD
) -> list[Match]:
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
    return compare_class(answers, solution, stubs, reference_prints(lab_id), threshold, course_prints())


def flags(matches: list[Match]) -> dict[str, str]:
    """learner -> one line for the scores table ("task2_time_op: bob 0.97, the course's solution 0.85; ...")."""
    grouped: dict[str, dict[str, list[str]]] = {}
    for m in matches:
        grouped.setdefault(m.learner, {}).setdefault(m.answer, []).append(f"{m.other} {m.score:.2f}")
    return {
        learner: "; ".join(f"{answer}: {', '.join(others)}" for answer, others in sorted(answers.items()))
        for learner, answers in grouped.items()
    }


def report(matches: list[Match], lab_id: str, learners: int) -> str:
    """The similarity report, as Markdown."""
    lines = [
        f"# Similar answers: {lab_id}",
        "",
        f"{learners} learners' answer cells compared with the course's solution, the lab's reference "
        f"functions, the grader's own code and each other, function by function, on their structure "
        f"(names, constants, comments, layout, the order of the functions and helpers split out or "
        f"pasted in do not count). A score is the share of the smaller function found in the larger; "
        f"pairs at {THRESHOLD:.2f} or more are listed, with the two functions that matched. This is a "
        f"signal to look at, not a verdict: short answers are not compared, and two learners can reach "
        f"the same code honestly.",
        "",
    ]
    if not matches:
        return "\n".join(lines + ["No close matches."]) + "\n"
    lines += ["| learner | answer | close to | score | functions |", "|---|---|---|---|---|"]
    lines += [f"| {m.learner} | {m.answer} | {m.other} | {m.score:.2f} | {m.pair} |" for m in matches]
    return "\n".join(lines) + "\n"
