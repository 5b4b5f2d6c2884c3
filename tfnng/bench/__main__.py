"""Command line of the benchmarks: ``python -m tfnng.bench <task> [options]``.

Tasks are registered in ``TASKS`` (task name -> module). A task module provides ``add_arguments(parser)``
and ``run(args)``; the first line of its docstring is the task's help text. ``args.command`` holds the
command line and ``args.code`` the code version at the start, for the JSON record.
"""

import argparse
import importlib
import sys

from tfnng.bench import _results

TASKS = {
    "uci": "tfnng.bench.uci",
    "speed": "tfnng.bench.speed",
    "logreg": "tfnng.bench.logreg",
    "kfac_digits": "tfnng.bench.kfac_digits",
}


def build_parser():
    """The argument parser with one sub-command per entry of ``TASKS``."""
    parser = argparse.ArgumentParser(prog="python -m tfnng.bench", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="task", required=True, metavar="TASK")
    for name, module_name in TASKS.items():
        module = importlib.import_module(module_name)
        summary = module.__doc__.strip().splitlines()[0]
        sub = subparsers.add_parser(name, help=summary, description=module.__doc__,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(sub)
        sub.set_defaults(run=module.run)
    return parser


def main(argv=None):
    """Parse ``argv`` (default: ``sys.argv[1:]``) and run the selected task."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.command = ["python", "-m", "tfnng.bench"] + argv
    args.code = _results.code_version()
    args.run(args)


if __name__ == "__main__":
    main()
