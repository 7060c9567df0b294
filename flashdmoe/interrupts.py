"""Ctrl-C that Python would drop, delivered again.

Python runs the SIGINT handler (which raises ``KeyboardInterrupt``) at the next bytecode of the main thread.
When that bytecode belongs to Python code called from C whose exceptions cannot propagate, such as an
at-fork callback, a ``__del__``, a weakref or garbage-collector callback, the ``KeyboardInterrupt`` is
reported as "Exception ignored in ..." and dropped, and the program goes on as if Ctrl-C had never been
pressed. ``ray.init`` starts every Ray process with a ``preexec_fn`` (a fork that runs the at-fork
callbacks, logging's among them), and a fork of a process that has imported torch takes long enough on a
busy machine for a Ctrl-C to land there: ``flashdmoe run`` then carried on and finished with status 0.

:func:`redeliver_dropped_interrupts` notices a dropped ``KeyboardInterrupt`` (``sys.unraisablehook``) and
has a helper thread send SIGINT to the main thread again, so that it is raised where it can propagate.
"""

from __future__ import annotations

import contextlib
import queue
import signal
import sys
import threading
from collections.abc import Iterator

__all__ = ["redeliver_dropped_interrupts"]


@contextlib.contextmanager
def redeliver_dropped_interrupts() -> Iterator[None]:
    """For the duration of the block, a ``KeyboardInterrupt`` that Python drops is raised again in the main
    thread (within milliseconds); other unraisable exceptions go to the previous ``sys.unraisablehook``.
    Does nothing outside the main thread, where no signal handler runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    main = threading.main_thread().ident
    dropped: queue.SimpleQueue[bool] = queue.SimpleQueue()

    def redeliver() -> None:
        # from another thread: a signal sent from the hook would be handled in the hook, and dropped again
        while dropped.get():
            signal.pthread_kill(main, signal.SIGINT)

    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        if unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt):
            dropped.put(True)  # last: nothing of this hook runs once the helper may send the signal
        else:
            previous(unraisable)

    helper = threading.Thread(target=redeliver, name="redeliver-sigint", daemon=True)
    helper.start()
    sys.unraisablehook = hook
    try:
        yield
    finally:
        if sys.unraisablehook is hook:
            sys.unraisablehook = previous
        dropped.put(False)
        helper.join()
