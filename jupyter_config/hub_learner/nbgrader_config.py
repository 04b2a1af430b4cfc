# A learner's nbgrader on the class's JupyterHub: the course's id and the exchange, from the one
# place the instructor's configuration reads them too (course_tools.classroom).
from course_tools.classroom import COURSE_ID, exchange_root

c = get_config()  # noqa: F821 (provided by nbgrader when it loads this file)
c.CourseDirectory.course_id = COURSE_ID
c.Exchange.root = str(exchange_root())
# A submission is readable by its learner and the instructor only (nbgrader's own is readable by all).
c.ExchangeFactory.submit = "course_tools.classroom.PrivateSubmit"
