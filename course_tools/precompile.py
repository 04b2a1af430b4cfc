"""Write the bytecode of what the course imports, once, right after the virtual environment is
filled: ``python -m course_tools.precompile`` (run by ``make``).

``make`` installs packages with ``pip --no-compile``: compiling every ``.py`` file in the
environment (about 18,000, most of them never imported: transformers' hundreds of models,
openai's types) took about a minute, single-threaded. Importing what the course uses writes
bytecode for those modules only (about 3,000), even where ``PYTHONDONTWRITEBYTECODE`` is set, so
later processes import them at full speed; a module left out here is compiled when it is
first imported.
"""

from __future__ import annotations

import importlib
import os
import sys
import time

from grading.course import PACKAGES

# The course's dependencies, as the lessons, labs, grader, server and tests import them, in two
# groups that share little, each imported by a process of its own (two cores, half the time).
TORCH_SIDE = [
    "torch",
    "torch._dynamo",
    "torch._inductor.compile_fx",
    "torch.distributed",
    "torch.profiler",
    "torch.nn.attention",
    "torch.export",
    "numpy",
    "triton",
    "triton.language",
    "transformers",
    "transformers.models.llama",
    "transformers.models.bert",
    "tokenizers",
    "safetensors.torch",
    "gguf",
    "regex",
    "faiss",
]
TOOL_SIDE = [
    "IPython",
    "ipykernel.kernelapp",
    "ipykernel.ipkernel",
    "ipywidgets",
    "jupyter_client",
    "nbformat",
    "nbclient",
    "nbconvert",
    "papermill",
    "nbgrader.apps",
    "nbgrader.api",
    "nbgrader.preprocessors",
    "jupyterlab.labapp",
    "jupyter_server.serverapp",
    "plotly.graph_objects",
    "plotly.subplots",
    "plotly.io",
    "tqdm.auto",
    "fastapi",
    "uvicorn",
    "httpx",
    "openai",
    "prometheus_client",
    "pydantic",
    "jsonschema",
    "langgraph.graph",
    "psutil",
    "latex2mathml.converter",
    "mistune",
    "jinja2",
    "pytest",
    "xdist",
    "hypothesis",
    "selenium.webdriver",
]


# Packages imported piecemeal, a few modules at a time, by code paths a plain import does not take
# (torch.compile's code generation, transformers' model classes, accelerate under transformers'
# GGUF reader): compiled whole, by the tools-side process, which has less to import.
WHOLE_PACKAGES = [
    "torch._inductor",
    "torch._dynamo",
    "torch._functorch",
    "torch.fx",
    "torch.distributed",
    "torch.export",
    "torch._export",
    "accelerate",
    "transformers.generation",
    "transformers.integrations",
    "transformers.quantizers",
    "transformers.loss",
    "transformers.distributed",
    "transformers.utils",
    "transformers.models.llama",
    "transformers.models.bert",
]
TOP_LEVEL_ONLY = ["transformers"]  # its own modules, not its hundreds of models


def _compile_packages(names: list[str]) -> list[str]:
    import compileall
    import importlib.util

    failed = []
    for name in names:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.submodule_search_locations:
            failed.append(f"{name} (not installed)")
            continue
        for folder in spec.submodule_search_locations:
            if not compileall.compile_dir(folder, quiet=2, maxlevels=0 if name in TOP_LEVEL_ONLY else None):
                failed.append(f"{name} (some files did not compile)")
    return failed


def _own_modules() -> list[str]:
    import pkgutil

    names = []
    for package in PACKAGES:
        module = importlib.import_module(package)
        names += [info.name for info in pkgutil.walk_packages(module.__path__, package + ".")]
    skip = {__name__, "course_tools.nbgrader_config"}  # nbgrader_config is a configuration file nbgrader loads
    return [name for name in names if name not in skip]


def _import_all(names: list[str]) -> list[str]:
    sys.dont_write_bytecode = False  # this process writes bytecode whatever the environment says
    os.environ.setdefault("TRITON_INTERPRET", "1")  # as the course imports Triton on a CPU
    failed = []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as error:  # noqa: BLE001 - an optional or platform-specific module
            failed.append(f"{name} ({type(error).__name__})")
    return failed


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--tools"]:
        failed = _import_all(TOOL_SIDE) + _compile_packages(WHOLE_PACKAGES + TOP_LEVEL_ONLY)
    else:
        import subprocess

        started = time.monotonic()
        tools = subprocess.Popen(
            [sys.executable, "-m", "course_tools.precompile", "--tools"], stdout=subprocess.PIPE, text=True
        )
        failed = _import_all(TORCH_SIDE + list(PACKAGES)) + _import_all(_own_modules())
        failed += [line for line in tools.communicate()[0].splitlines() if line]
        print(
            f"bytecode written for the modules the course imports in {time.monotonic() - started:.0f} s"
            + (f"; not importable here: {', '.join(failed)}" if failed else "")
        )
        return 0
    print("\n".join(failed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
