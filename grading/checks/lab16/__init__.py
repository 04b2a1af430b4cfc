"""Capstone checks: the learner's engine, assembled from their labs' pieces, against the course's.

The implementation a check receives is ``{lab id: function}``: the capstone notebook's answer
cells, each returning its lab's pieces (``infra-lab capstone build`` writes them from the lab
notebooks). A check calls the functions it needs, so a blank cell raises its own task's stub, and
runs SmolLM2-135M-Instruct through ``infra_lib.serving.pieces.assemble``. The course's side is the
same driver with the course's pieces, run (under the grader) in the grader's own process.

Tasks 1-4 put one piece into the course's engine at a time, so that a failure names the piece
(``pieces``); task 5 runs every engine piece of the learner's that is written together, the course's
filling in for the rest as in ``infra-lab serve --engine learner`` (``assembled``): the same answers,
streaming, aborts under load, a seeded workload, and throughput as the median ratio of paired rounds
timed in turns with the course's engine (``throughput``).
"""

from grading.registry import register_answer_labs, register_shortcuts

from . import assembled, pieces, throughput  # noqa: F401  (each module registers its checks, in the lab's order)
from .engine import LABS

# The course's engine runs around one learner piece in tasks 1-4, so its model, pool, scheduler, runner and
# loop cannot be shortcuts while the checks run (pieces_of refuses a piece that is the course's own). Each
# answer cell is scanned with its own lab's rules (ANSWER_LABS); only the acceptance rule, which no course
# code calls while the learner's is in place, is watched as a call.
register_shortcuts("lab16", ["infra_lib.serving.speculative:accept_or_resample"])
register_answer_labs("lab16", {lab: lab for lab in LABS})
