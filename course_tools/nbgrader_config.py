"""nbgrader configuration for this course: `nbgrader <command> --config course_tools/nbgrader_config.py`.

solutions/ is nbgrader's source directory (instructor notebooks with hidden tests) and
labs/ its release directory (what learners get). Run nbgrader from the repository root.
"""

from course_tools.classroom import COURSE_ID, course_root, exchange_root

c = get_config()  # noqa: F821 (provided by nbgrader when it loads this file)

c.CourseDirectory.course_id = COURSE_ID
c.CourseDirectory.root = str(course_root())
# The exchange between the instructor and the learners (release, submit, collect, feedback):
# exchange/ in the course folder unless INFRA_EXCHANGE_ROOT names another (course_tools.classroom).
c.Exchange.root = str(exchange_root())
c.CourseDirectory.source_directory = "solutions"
c.CourseDirectory.release_directory = "labs"

# The learner's stub: the solution region becomes this comment, and the line after the
# region, `raise NotImplementedError("labNN task N: name")`, names the task.
c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE"}

# torch imports and profiles take longer than nbgrader's 30 s default.
c.Execute.timeout = 300
c.Execute.startup_timeout = 120
c.Execute.interrupt_on_timeout = True

# nbgrader scores a test cell zero when it wrote anything to stderr; torch's profiler and
# library warnings write there without anything being wrong.
c.IgnorePattern.enabled = True
c.IgnorePattern.pattern = r"(?i)warn|USDT:|STAGE:|profiler_(start|stop)"

# A learner who deleted a test cell gets it back rather than a silent zero.
c.OverwriteCells.add_missing_cells = True

# Each notebook's kernel forks from a process that has already imported torch (grading.run.warm):
# about 3 s of CPU less per notebook graded, nothing else changed (no limits are added; the
# course's own grader is the one that sandboxes). INFRA_LAB_COLD_KERNELS=1 turns it off.
try:
    from grading.run.warm import nbgrader_warm_kernels
except ImportError:  # nbgrader run from another environment than the course's
    pass
else:
    nbgrader_warm_kernels()
