"""The child that executes a graded notebook: ``python -m grading.run.child IN OUT --kernel K ...``.

It runs papermill with a per-cell time-out (the kernel is interrupted and the next cell runs),
errors allowed (one broken answer does not stop the rest) and a cap on each cell's output, and
writes the id of each cell as it starts to the progress file the parent watches
(:func:`grading.run.execute.execute`). Its exit code says how the run ended. The grading process's
template (:mod:`grading.run.warm`) forks it with papermill already imported, or the parent starts it
as a process of its own.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import nbformat

EXIT_COMPLETE = 0
EXIT_KERNEL_DIED = 3
EXIT_OTHER = 4


def _limit_output(client_class, limit_bytes: int) -> None:
    """Cap the output kept per cell; errors always pass, so failures stay visible."""
    original = client_class.output

    def output(self, outs, msg, display_id, cell_index):
        sizes = self.__dict__.setdefault("_infra_output_bytes", {})
        if msg.get("msg_type") != "error":
            size = len(json.dumps(msg.get("content", {}), default=str))
            sizes[cell_index] = sizes.get(cell_index, 0) + size
            if sizes[cell_index] > limit_bytes:
                cell = self.nb.cells[cell_index]
                if not cell.metadata.get("infra_lab", {}).get("output_truncated"):
                    cell.metadata.setdefault("infra_lab", {})["output_truncated"] = True
                    note = nbformat.v4.new_output(
                        "stream",
                        name="stdout",
                        text=f"\n[the grader dropped this cell's output past {limit_bytes // 1024} KiB]\n",
                    )
                    outs.append(note)
                return None
        return original(self, outs, msg, display_id, cell_index)

    client_class.output = output


def main(argv: list[str] | None = None) -> int:
    """Run the notebook ``argv`` names; the exit code says how it ended (``EXIT_*``)."""
    import ast
    import logging

    from nbclient.exceptions import DeadKernelError
    from papermill.clientwrap import PapermillNotebookClient
    from papermill.exceptions import PapermillExecutionError

    from grading.run.papermill_ipc import run_with_papermill

    parser = argparse.ArgumentParser()
    parser.add_argument("source")
    parser.add_argument("output")
    parser.add_argument("--kernel", required=True)
    parser.add_argument("--cell-timeout", type=float, required=True)
    parser.add_argument("--output-kb", type=int, required=True)
    parser.add_argument("--cwd", required=True)
    parser.add_argument("--progress", required=True, help="file that gets the id of each cell as it starts")
    parser.add_argument("-p", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"))
    args = parser.parse_args(argv)
    logging.getLogger("papermill").setLevel(logging.ERROR)
    progress = Path(args.progress)
    execute_cell = PapermillNotebookClient.execute_cell

    def tracked_execute_cell(self, cell, cell_index, *more, **kwargs):
        progress.write_text(cell.get("id", ""), encoding="utf-8")
        return execute_cell(self, cell, cell_index, *more, **kwargs)

    PapermillNotebookClient.execute_cell = tracked_execute_cell
    _limit_output(PapermillNotebookClient, args.output_kb * 1024)
    try:
        run_with_papermill(  # Unix sockets: the kernel may have no network
            args.source,
            args.output,
            parameters={name: ast.literal_eval(value) for name, value in args.p},
            kernel_name=args.kernel,
            cwd=args.cwd,
            progress_bar=False,
            request_save_on_cell_execute=True,
            execution_timeout=args.cell_timeout,
            allow_errors=True,
            interrupt_on_timeout=True,
            start_timeout=120,
        )
    except PapermillExecutionError:
        pass  # a cell raised: allowed, the verdicts read it from the output notebook
    except DeadKernelError as exc:
        print(f"dead kernel: {exc}", file=sys.stderr)
        return EXIT_KERNEL_DIED
    except Exception as exc:
        if "dead" in str(exc).lower() or "died" in str(exc).lower():
            print(f"dead kernel: {exc}", file=sys.stderr)
            return EXIT_KERNEL_DIED
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_OTHER
    return EXIT_COMPLETE


if __name__ == "__main__":
    sys.exit(main())
