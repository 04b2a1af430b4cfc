"""The reference implementation of every layer of the course, from the roofline to agents.

Layers never import upward: ``hardware`` and ``kernels`` know nothing of ``serving``;
``infra_lib`` never imports ``grading``.
"""

__version__ = "0.1.0"
