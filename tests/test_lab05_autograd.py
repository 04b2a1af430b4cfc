"""Lab 05 tasks 1 to 5 (the learner's autograd engine, its ops, AdamW, and the tiny Llama trained with them):
a learner-style answer (tests/learner_style/autograd.py) and the course's own autograd pass every check, an
untouched namespace fails every one as not started, each classic mistake fails its own task's checks with
its own hint (and the training check names that task), and the course's tiny run equals torch's."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import check_fails
from learner_style import autograd as learner

import grading.checks.lab05.autograd_engine  # noqa: F401  (registers the checks)
import grading.checks.lab05.autograd_ops  # noqa: F401
import grading.checks.lab05.training_run  # noqa: F401
from grading import check
from grading.checks.lab05.autograd_cases import TASK_NAMES
from grading.checks.lab05.autograd_engine import ACCUMULATE, ONCE, RECURSION, SUM_OF_SHARES
from grading.checks.lab05.autograd_ops import BROADCAST, EXP, LOG, MEAN, POSITIONS, REDUCTION, REPEAT, RMS, ROW

CHECKS = {
    "lab05.autograd_engine": 1,
    "lab05.autograd_engine_edges": 1,
    "lab05.elementwise": 2,
    "lab05.elementwise_edges": 2,
    "lab05.matmul_reductions": 3,
    "lab05.matmul_reductions_edges": 3,
    "lab05.model_ops": 4,
    "lab05.model_ops_edges": 4,
}
TASK_TITLES = {
    1: "lab05 task 1: Value",
    2: "lab05 task 2: add, mul, exp, log",
    3: "lab05 task 3: matmul, reduce_sum, reduce_mean",
    4: "lab05 task 4: softmax, rms_norm, embedding, cross_entropy",
    5: "lab05 task 5: adamw_update",
}


def _for_task(namespace: dict, task: int) -> dict:
    return {name: namespace[name] for name in TASK_NAMES[task]}


def _implementation(check_id: str, namespace: dict):
    """What the lab's test cell passes to ``check_id``, taken from a whole namespace."""
    if check_id in CHECKS:
        return _for_task(namespace, CHECKS[check_id])
    if check_id == "lab05.train_tiny":
        return dict(namespace)
    return namespace["adamw_update"]


def _run(check_id: str, namespace: dict):
    """``check``'s failure message for one check of tasks 1 to 5 given a whole namespace, or None when it passes."""
    try:
        check(check_id, _implementation(check_id, namespace))
    except AssertionError as failure:
        return str(failure)
    return None


def _course_namespace() -> dict:
    from infra_lib.training.autograd import library_ops
    from infra_lib.training.scratch_train import adamw_update

    return {**library_ops(), "adamw_update": adamw_update}


ALL_CHECKS = (*CHECKS, "lab05.adamw_update", "lab05.adamw_edges", "lab05.train_tiny")


@pytest.mark.parametrize("check_id", ALL_CHECKS)
def test_learner_style_and_course_answers_pass(check_id):
    assert _run(check_id, learner.namespace()) is None
    assert _run(check_id, _course_namespace()) is None


# --- an untouched notebook ---------------------------------------------------------------------------


def _blank() -> dict:
    class Value:
        def __init__(self, data, parents=(), backward_fn=None):
            raise NotImplementedError("lab05 task 1: Value")

        def backward(self, grad=None):
            raise NotImplementedError("lab05 task 1: Value")

    def stub(task: int):
        def op(*args, **kwargs):
            raise NotImplementedError(TASK_TITLES[task])

        return op

    ops = {name: stub(task) for task in (2, 3, 4) for name in TASK_NAMES[task] if name != "Value"}
    return {"Value": Value, **ops, "adamw_update": stub(5)}


@pytest.mark.parametrize("check_id", ALL_CHECKS)
def test_an_untouched_namespace_fails_every_check_as_not_started(check_id):
    text = _run(check_id, _blank())
    assert text is not None and "(error)" in text
    own = CHECKS.get(check_id, 5 if "adamw" in check_id else None)
    if own == 1 or (own == 5 and check_id != "lab05.train_tiny"):
        assert f"lab05 task {own} is not started yet" in text
    else:  # the ops' checks and the training check make Values first: task 1 is what is missing
        assert "this check also runs lab05 task 1 (Value), which is not written yet" in text


# --- the classic mistakes ----------------------------------------------------------------------------


def _engine(*, accumulate=True, recursive=False, keep=True, in_order=True, halves=False, copy=True):
    """A micrograd-style engine with one deliberate change (none: a correct engine)."""

    class Value:
        def __init__(self, data, parents=(), backward_fn=None):
            self.data, self.parents, self.backward_fn, self.grad = data, tuple(parents), backward_fn, None

        def backward(self, grad=None):
            if grad is None:
                if self.data.numel() != 1:
                    raise ValueError("backward() needs a gradient here")
                grad = torch.ones_like(self.data)
            if not in_order:  # push each share down as soon as it exists
                self._push(grad.clone())
                return
            order, seen = [], set()
            if recursive:

                def visit(node):
                    if id(node) not in seen:
                        seen.add(id(node))
                        for parent in node.parents:
                            visit(parent)
                        order.append(node)

                visit(self)
            else:
                stack = [(self, False)]
                while stack:
                    node, done = stack.pop()
                    if done:
                        order.append(node)
                    elif id(node) not in seen:
                        seen.add(id(node))
                        stack.append((node, True))
                        stack.extend((p, False) for p in node.parents)
            pending = {id(self): grad.clone()}
            for node in reversed(order):
                mine = pending.pop(id(node), None)
                if mine is None:
                    continue
                node.grad = mine if node.grad is None or not keep else node.grad + mine
                if node.backward_fn is None:
                    continue
                shares = node.backward_fn(mine)
                if halves:  # the same numbers from two calls
                    shares = [a if a is None else a / 2 + b / 2 for a, b in zip(shares, node.backward_fn(mine))]
                for parent, share in zip(node.parents, shares):
                    if share is not None:
                        both = accumulate and id(parent) in pending
                        first = share.clone() if copy else share  # copy=False: a share two parents may hold
                        pending[id(parent)] = pending[id(parent)] + share if both else first

        def _push(self, grad):
            self.grad = grad if self.grad is None else self.grad + grad
            if self.backward_fn is not None:
                for parent, share in zip(self.parents, self.backward_fn(grad)):
                    if share is not None:
                        parent._push(share.clone())

    return Value


def _with(changes: dict, monkeypatch) -> dict:
    """The learner's namespace with some names changed; another Value class is the one its ops build with."""
    if "Value" in changes:
        monkeypatch.setattr(learner, "Value", changes["Value"])
    return {**learner.namespace(), **changes}


def test_a_micrograd_style_engine_passes(monkeypatch):
    namespace = _with({"Value": _engine()}, monkeypatch)
    for check_id in ("lab05.autograd_engine", "lab05.autograd_engine_edges", "lab05.model_ops", "lab05.train_tiny"):
        assert _run(check_id, namespace) is None, check_id


def _no_unbroadcast(a, b):
    return learner.Value(a.data * b.data, (a, b), lambda g: (g * b.data, g * a.data))


def _add_no_unbroadcast(a, b):
    return learner.Value(a.data + b.data, (a, b), lambda g: (g, g))


def _exp_share_without_its_output(x):
    return learner.Value(torch.exp(x.data), (x,), lambda g: (g.clone(),))


def _log_share_times_x(x):
    return learner.Value(torch.log(x.data), (x,), lambda g: (g * x.data,))


def _sum_not_put_back(x, dim=None, keepdim=False):
    out = torch.sum(x.data, dim=dim, keepdim=keepdim)
    return learner.Value(out, (x,), lambda g: (g.expand(x.data.shape).clone(),))


def _mean_not_divided(x, dim=None, keepdim=False):
    out = torch.mean(x.data, dim=dim, keepdim=keepdim)
    return learner.Value(out, (x,), lambda g: (learner.reduce_sum(x, dim, keepdim).backward_fn(g)[0],))


def _softmax_without_the_row(x, causal=False):
    p = learner.softmax(x, causal).data
    return learner.Value(p, (x,), lambda g: (p * g,))


def _rms_norm_through_weight_only(x, weight, eps):
    rms = torch.sqrt((x.data**2).mean(dim=-1, keepdim=True) + eps)

    def backward(g):
        return g * weight.data / rms, (g * x.data / rms).reshape(-1, x.data.shape[-1]).sum(0)

    return learner.Value(x.data / rms * weight.data, (x, weight), backward)


def _embedding_overwrites(ids, table):
    def backward(g):
        grad = torch.zeros_like(table.data)
        grad[ids.reshape(-1)] = g.reshape(-1, table.data.shape[1])
        return (grad,)

    return learner.Value(table.data[ids], (table,), backward)


def _cross_entropy_summed(logits, targets):
    mean = learner.cross_entropy(logits, targets)
    n = targets.numel()
    return learner.Value(mean.data, (logits,), lambda g: (mean.backward_fn(g)[0] * n,))


def _adamw_coupled(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay):
    learner.adamw_update(param, grad + weight_decay * param, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, 0.0)


def _adamw_uncorrected(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay):
    param.mul_(1 - lr * weight_decay)
    exp_avg.mul_(beta1).add_((1 - beta1) * grad)
    exp_avg_sq.mul_(beta2).add_((1 - beta2) * grad * grad)
    param.sub_(lr * exp_avg / (exp_avg_sq.sqrt() + eps))


def _z_loss_share(op: str, task: int) -> str:
    """What the training check says of a wrong share of an op that only the loss's z-loss term calls (once)."""
    return (
        f"your {op} (call 1 of 1 in the model's forward) returned another share for x than torch's from the same "
        f"incoming gradient: {op} is task {task}"
    )


# name -> (changes to the learner's namespace, {check id that must fail: a phrase of its hint}, what
# train_tiny says: None when it passes)
MISTAKES = {
    "engine overwrites a reused value's gradient": (
        {"Value": _engine(accumulate=False)},
        {"lab05.autograd_engine": SUM_OF_SHARES, "lab05.autograd_engine_edges": SUM_OF_SHARES},
        "task 1, the engine's sums",
    ),
    "engine recurses": ({"Value": _engine(recursive=True)}, {"lab05.autograd_engine_edges": RECURSION}, None),
    "engine forgets the last backward's gradients": (
        {"Value": _engine(keep=False)},
        {"lab05.autograd_engine": ACCUMULATE},
        None,
    ),
    "engine overwrites .grad on a second backward, storing shares as they come": (
        {"Value": _engine(keep=False, copy=False)},
        {"lab05.autograd_engine": ACCUMULATE},
        None,
    ),
    "engine passes shares on before they are complete": (
        {"Value": _engine(in_order=False)},
        {"lab05.autograd_engine": ONCE, "lab05.autograd_engine_edges": RECURSION},
        "times: task 1",
    ),
    "add does not undo broadcasting": (
        {"add": _add_no_unbroadcast},
        {"lab05.elementwise": BROADCAST, "lab05.elementwise_edges": BROADCAST},
        None,  # the tiny Llama adds no broadcast bias
    ),
    "mul does not undo broadcasting": (
        {"mul": _no_unbroadcast},
        {"lab05.elementwise": BROADCAST, "lab05.elementwise_edges": BROADCAST},
        "your mul's backward_fn gave parent 1",
    ),
    "exp's share leaves out its output": (
        {"exp": _exp_share_without_its_output},
        {"lab05.elementwise": EXP, "lab05.elementwise_edges": EXP},
        _z_loss_share("exp", 2),
    ),
    "log's share multiplies by x": (
        {"log": _log_share_times_x},
        {"lab05.elementwise": LOG, "lab05.elementwise_edges": LOG},
        _z_loss_share("log", 2),
    ),
    "reduce_sum does not put the reduced dim back": (
        {"reduce_sum": _sum_not_put_back},
        {"lab05.matmul_reductions": REDUCTION, "lab05.matmul_reductions_edges": REDUCTION},
        "your reduce_sum's backward_fn raised RuntimeError",  # the z-loss sums [batch, t, vocab] over vocab
    ),
    "reduce_mean does not divide": (
        {"reduce_mean": _mean_not_divided},
        {"lab05.matmul_reductions": MEAN, "lab05.matmul_reductions_edges": MEAN},
        _z_loss_share("reduce_mean", 3),
    ),
    "softmax without the row term": (
        {"softmax": _softmax_without_the_row},
        {"lab05.model_ops": ROW, "lab05.model_ops_edges": ROW},
        "your softmax (call 2 of 2 in the model's forward) returned another share for x",
    ),
    "rms_norm only through the weight": (
        {"rms_norm": _rms_norm_through_weight_only},
        {"lab05.model_ops": RMS, "lab05.model_ops_edges": RMS},
        "your rms_norm (call 5 of 5 in the model's forward) returned another share for x",
    ),
    "embedding overwrites repeated ids": (
        {"embedding": _embedding_overwrites},
        {"lab05.model_ops": REPEAT, "lab05.model_ops_edges": REPEAT},
        "your embedding (call 1 of 1 in the model's forward) returned another share for table",
    ),
    "cross_entropy not divided by the positions": (
        {"cross_entropy": _cross_entropy_summed},
        {"lab05.model_ops": POSITIONS, "lab05.model_ops_edges": POSITIONS},
        "your cross_entropy (call 1 of 1 in the model's forward) returned another share for logits",
    ),
    "weight decay coupled to the gradient": (
        {"adamw_update": _adamw_coupled},
        {"lab05.adamw_update": "that is Adam's L2 penalty", "lab05.adamw_edges": "that is Adam's L2 penalty"},
        "your adamw_update (task 5)",
    ),
    "no bias correction": (
        {"adamw_update": _adamw_uncorrected},
        {"lab05.adamw_update": "need the bias corrections", "lab05.adamw_edges": "need the bias corrections"},
        "your adamw_update (task 5)",
    ),
}


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_each_mistake_fails_its_own_tasks_checks_with_its_hint(mistake, monkeypatch):
    changes, failing, _ = MISTAKES[mistake]
    namespace = _with(changes, monkeypatch)
    results = {check_id: _run(check_id, namespace) for check_id in ALL_CHECKS if check_id != "lab05.train_tiny"}
    assert {check_id for check_id, text in results.items() if text} == set(failing)
    for check_id, hint in failing.items():
        assert hint in results[check_id].split("hint: ", 1)[1], (check_id, results[check_id])


# the engine that passes shares on at once runs each backward_fn once per path: seconds of the suite's time
SLOW = {"engine passes shares on before they are complete"}


@pytest.mark.parametrize(
    "mistake", [m for m, (*_, said) in MISTAKES.items() if said and m not in SLOW] + ["add does not undo broadcasting"]
)
def test_training_with_a_mistake_names_its_task(mistake, monkeypatch):
    changes, _, said = MISTAKES[mistake]
    text = _run("lab05.train_tiny", _with(changes, monkeypatch))
    if said is None:
        assert text is None
        return
    assert text is not None and said in text, text
    if "left torch's loss curve at step" in text:
        step = int(text.split("loss curve at step ")[1].split()[0])
        assert f"the first {step - 1} losses agree" in text


def test_training_fails_an_engine_that_runs_a_backward_fn_twice_even_with_the_right_numbers(monkeypatch):
    """Two calls give the same shares here, but the contract is one call per node: on a graph of many paths an
    engine that calls a node once per arriving share takes exponential time."""

    text = _run("lab05.train_tiny", _with({"Value": _engine(halves=True)}, monkeypatch))
    assert text is not None and "ran 2 times" in text and "task 1: a node passes its gradient on once" in text


def test_training_names_an_op_whose_error_stays_inside_the_tolerance_of_the_losses_and_gradients(monkeypatch):
    """exp's share by a forward difference of step 1e-4 is 5e-5 too large; in the tiny Llama exp feeds only the
    z-loss, at most some 1e-3 of each parameter's gradient, so the losses and gradients agree to 1e-6: the op-by-op
    view of the first step still names exp."""

    def exp_by_a_forward_difference(x):
        out = torch.exp(x.data)
        return learner.Value(out, (x,), lambda g: (g * (torch.exp(x.data + 1e-4) - out) / 1e-4,))

    namespace = _with({"exp": exp_by_a_forward_difference}, monkeypatch)
    assert _run("lab05.elementwise", namespace) is not None
    text = _run("lab05.train_tiny", namespace)
    assert text is not None and "one of your ops differs from torch's, though the losses and gradients agree" in text
    assert "hint: on the first step your exp (call 1 of 1 in the model's forward) returned another share for x" in text
    assert "exp is task 2" in text


def test_hidden_mistake_hints_name_no_input():
    """A hidden check shows its hint: the hint of a mistake names the idea, never a shape or a value."""
    text = check_fails(
        "lab05.model_ops_edges", _for_task({**learner.namespace(), "softmax": _softmax_without_the_row}, 4)
    )
    hint = text.split("hint: ", 1)[1]
    assert hint == ROW and not any(ch.isdigit() for ch in hint)


def test_the_feedback_names_the_op_the_parent_and_the_input():
    text = check_fails("lab05.elementwise", _for_task({**learner.namespace(), "mul": _no_unbroadcast}, 2))
    assert "the share of b (parent 1) from mul's backward_fn has the wrong shape" in text
    assert "a scale per feature: mul(a [2, 3, " in text and "float64" in text
    text = check_fails("lab05.model_ops", _for_task({**learner.namespace(), "embedding": _embedding_overwrites}, 4))
    assert "rows that several ids picked" in text and "the rows picked once agree" in text


def test_an_engine_that_keeps_a_shared_share_is_told_to_own_its_grad():
    """add hands one tensor to both parents: storing it as .grad without a copy, then adding in place, changes both."""

    class Sharing(learner.Value):
        def backward(self, grad=None):
            grad = torch.ones_like(self.data) if grad is None else grad
            order, seen, stack = [], set(), [(self, False)]
            while stack:
                node, done = stack.pop()
                if done:
                    order.append(node)
                elif id(node) not in seen:
                    seen.add(id(node))
                    stack += [(node, True)] + [(p, False) for p in node.parents]
            pending = {id(self): grad}
            for node in reversed(order):
                mine = pending.pop(id(node), None)
                if mine is None:
                    continue
                if node.grad is None:
                    node.grad = mine
                else:
                    node.grad += mine  # in place, on a tensor another node may hold too
                if node.backward_fn is not None:
                    for parent, share in zip(node.parents, node.backward_fn(mine)):
                        if share is not None:
                            pending[id(parent)] = pending[id(parent)] + share if id(parent) in pending else share

    text = check_fails("lab05.autograd_engine", {"Value": Sharing})
    assert "a node must own its .grad" in text and "backward called twice" in text


# --- the seams: the learner's dict, and torch.autograd refused ------------------------------------------


def test_a_wrong_dict_is_a_type_error_that_lists_the_names():
    text = check_fails("lab05.elementwise", {"Value": learner.Value, "add": learner.add})
    assert "TypeError" in text and "lacks mul, exp, log" in text and '"exp": exp' in text
    text = check_fails("lab05.autograd_engine", learner.Value)
    assert "takes a dict of your names" in text and '{"Value": Value}' in text
    text = check_fails("lab05.train_tiny", {**learner.namespace(), "extra": 1})
    assert "has 'extra'" in text


def test_torch_autograd_refuses_to_run_for_the_learners_ops():
    def exp_by_autograd(x):
        def backward(g):
            leaf = x.data.clone().requires_grad_(True)
            return torch.autograd.grad(torch.exp(leaf), leaf, g)

        return learner.Value(torch.exp(x.data), (x,), backward)

    text = check_fails("lab05.elementwise", _for_task({**learner.namespace(), "exp": exp_by_autograd}, 2))
    assert "ask for the backward formula itself" in text
    leaf = torch.ones(2, requires_grad=True)  # torch's autograd works again after the check
    (leaf * 3).sum().backward()
    assert leaf.grad.tolist() == [3.0, 3.0]


# --- the course's run against torch ------------------------------------------------------------------


def test_train_tiny_with_the_course_ops_equals_torch_autograd_and_adamw():
    from infra_lib.training.scratch_train import train_tiny, train_tiny_torch

    ours, theirs = {}, {}
    losses = train_tiny(8, seed=3, first_grads=ours)
    expected = train_tiny_torch(8, seed=3, first_grads=theirs)
    assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(losses, expected)) and len(losses) == 8
    assert losses[-1] < losses[0]
    assert sorted(ours) == sorted(theirs) and "lm_head.weight" not in ours  # the tied table once
    for name, grad in theirs.items():
        assert (ours[name] - grad).abs().max() <= 1e-6 * grad.abs().max(), name
    mine = {}
    assert train_tiny(3, seed=3, ops=learner.namespace(), first_grads=mine) == pytest.approx(losses[:3], rel=1e-9)


def test_train_tiny_names_a_parameter_left_without_a_gradient():
    from infra_lib.training.autograd import library_ops
    from infra_lib.training.scratch_train import train_tiny

    ops = library_ops()

    def rms_norm_without_weight_share(x, weight, eps):
        out = ops["rms_norm"](x, weight, eps)
        backward = out.backward_fn
        out.backward_fn = lambda grad: (backward(grad)[0], None)
        return out

    with pytest.raises(RuntimeError, match=r"parameter layers\.0\.input_layernorm\.weight \(32,\) holds \.grad None"):
        train_tiny(1, ops={**ops, "rms_norm": rms_norm_without_weight_share})


def test_in_a_graded_kernel_the_course_engine_is_a_stub_and_the_training_check_runs_on_the_learners():
    """Graded in the sandbox, the kernel sees the course's Value (the engine's reference) as a stub: llama_loss and
    the plumbing must build the tiny Llama from the learner's names alone."""
    import types
    from pathlib import Path

    from grading.hidden_reference import stub_source
    from infra_lib.training import autograd
    from infra_lib.training.scratch_train import tiny_setup

    path = Path(autograd.__file__)
    stubbed = types.ModuleType("stubbed_autograd")
    source = stub_source(path.read_text(encoding="utf-8"), {"Value": None}, "lab05", "infra_lib.training.autograd")
    exec(compile(source, str(path), "exec"), stubbed.__dict__)  # noqa: S102 (the course's own module, stubbed)
    with pytest.raises(RuntimeError, match="it is not available while lab05 is graded"):
        stubbed.Value(torch.zeros(2))
    model, batches, _ = tiny_setup(4)
    tokens, targets = next(batches)
    loss, params = stubbed.llama_loss(model, tokens, targets, learner.namespace())
    loss.backward()
    expected, _ = autograd.llama_loss(model, tokens, targets)
    assert type(loss) is learner.Value and float(loss.data) == pytest.approx(float(expected.data), rel=1e-12)
    assert all(type(p) is learner.Value and p.grad is not None for p in params.values())


def test_the_learners_checks_never_call_the_course_engine_or_update_and_the_course_ops_do():
    """With the course's Value and adamw_update as the lab's reference shortcuts (what the call monitor watches
    under the grader), driving a learner's namespace calls none of them; a course op is caught at once."""
    from grading.call_monitor import CallMonitor
    from grading.registry import get_check
    from infra_lib.training.autograd import Value, add
    from infra_lib.training.scratch_train import adamw_update

    watched = [v for v in vars(Value).values() if callable(v) and hasattr(v, "__code__")] + [adamw_update]

    def hits(run) -> list[str]:
        monitor = CallMonitor(watched)
        monitor.start()
        try:
            run()
        finally:
            monitor.stop()
        return monitor.hits

    for check_id in ALL_CHECKS:
        registered = get_check(check_id)
        implementation = _implementation(check_id, learner.namespace())
        assert hits(lambda: registered.drive(implementation, registered.inputs(3))) == [], check_id
    assert "Value" in hits(lambda: add(torch.ones(1), torch.ones(1)))[0]
