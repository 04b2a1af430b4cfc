# nbgrader reads nbgrader_config.py from the folder it runs in; the course's settings live in
# course_tools/nbgrader_config.py (solutions/ is the source directory, labs/ the release directory).
c = get_config()  # noqa: F821
load_subconfig("course_tools/nbgrader_config.py")  # noqa: F821
