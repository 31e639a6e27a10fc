"""`python -m streamer` and the `streamer` command: the command line (:mod:`streamer.cli`).

Ctrl-C counts from this file's first line, not only once the command line is imported (a
noticeable fraction of a second): a SIGINT during the imports exits 130 like one later, and
a process started with SIGINT ignored (a shell script's background job) takes it as well,
as every role and `up` do once running. Only the interpreter's own start comes before this.

The imports run with the cyclic garbage collector off: they make hundreds of thousands of
objects that live as long as the process (~400,000 with torch and transformers), and the
collector's passes over them while they are made cost ~1 CPU second. Once the command's code
is imported, :func:`streamer.cli.main` freezes them (``gc.freeze``: later collections leave
them alone) and turns the collector back on.
"""

import gc
import signal
import sys


def run() -> int:
    gc.disable()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        from streamer import lifecycle

        lifecycle.take_finish_signal()  # `up`'s "the producers are done", kept until the trainer reads it
        from streamer.cli import main

        return main()
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(run())
