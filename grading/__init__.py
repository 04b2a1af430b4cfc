"""The course's autograder: the check API, the notebook grader and its reports.

Labs write tests one way only::

    from grading import check
    check("lab01.gemm_flops", gemm_flops)
"""

from grading.check import check

__all__ = ["check"]
