"""A specsplit command as a process: its logging set up, its errors one line on stderr, its exit prompt.

``specsplit.cli`` runs every subcommand through ``run_and_exit``, and so does each
service's own ``python -m specsplit.<component>.server``, which the demo, the
benchmarks, Ray's service actors and the tensor-parallel ranks start. Light:
``specsplit generate`` in the light client runs through it too.
"""

from __future__ import annotations

import argparse
import gc
import logging
import sys
from typing import Callable, NoReturn

from specsplit.lmkit import errors, logs


def run_and_exit(
    name: str, run: Callable[[argparse.Namespace], int | None], args: argparse.Namespace,
    log_prefix: str | None = None, quiet: bool = False,
) -> NoReturn:
    """``run(args)``, then exit with its code (None: 0); bad input is ``specsplit NAME: error: ...`` and 2.

    ``log_prefix``: log at ``--log-level``/``--log-format`` as this component (else the command sets up its
    own); ``quiet``: log warnings and errors only.
    """
    if log_prefix is not None:
        logs.configure(args.log_level, log_prefix, args.log_format)
    elif quiet:
        logging.basicConfig(level=logging.WARNING)
    try:
        code = run(args)
    except (ValueError, FileNotFoundError, errors.SpecsplitError) as exc:
        print(f"specsplit {name}: error: {exc}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 130
    # Leave promptly: with torch, transformers or Ray loaded, the interpreter's last garbage collection
    # of their object graph takes seconds. Frozen objects are skipped; logs are flushed by logging's
    # atexit hook and the std streams by the interpreter, so nothing waits on that collection.
    gc.freeze()
    sys.exit(code or 0)
