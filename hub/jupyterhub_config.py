# JupyterHub's configuration for a class of this course: `make hub` (infra-lab hub) runs
# `jupyterhub -f hub/jupyterhub_config.py` with the class's folder in INFRA_HUB_CLASS.
# Everything is set in course_tools.hub.configure; a file given to `infra-lab hub --config FILE`
# is read after it and may change anything (a university's own authenticator, for example).
import os
from pathlib import Path

from course_tools.hub import CLASS_ENV, ClassFolder, configure

c = get_config()  # noqa: F821 (provided by JupyterHub when it loads this file)
configure(c, ClassFolder(Path(os.environ[CLASS_ENV])))
if os.environ.get("INFRA_HUB_EXTRA_CONFIG"):
    load_subconfig(os.environ["INFRA_HUB_EXTRA_CONFIG"])  # noqa: F821
