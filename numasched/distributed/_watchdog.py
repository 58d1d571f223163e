"""A wall-clock limit for one step of a multi-process run (tests/dist_worker.py, the distributed bench).

A hung GPU kernel or a collective that one rank never joins cannot be interrupted from Python, and
NCCL's own watchdog only fires after the process group's timeout with no hint of *what* hung. So:
``with Watchdog(rank).limit("label", seconds):`` starts a timer; if the step is still running when
it fires, the rank prints the label, dumps every thread's Python stack (faulthandler), tries to
abort the default process group (so peers blocked in a collective with us error out instead of
waiting for NCCL's timeout) and exits with code 3; torchrun then stops the other ranks. A
faulthandler timer a little later is the backstop for a main thread that holds the GIL: it dumps
the stacks and exits without needing Python to run.
"""
from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time

EXIT_CODE = 3


class Watchdog:
    def __init__(self, rank: int, *, stream=None, backstop_s: float = 30.0):
        self.rank = rank
        self.stream = stream or sys.stderr
        self.backstop_s = backstop_s
        self._timer = None
        self.label = ""

    def _fire(self, label: str, seconds: float, t0: float):
        out = self.stream
        try:
            print(f"\n[rank {self.rank}] WATCHDOG: '{label}' still running after {time.perf_counter() - t0:.0f} s "
                  f"(limit {seconds:g} s); Python stacks of every thread follow, then exit {EXIT_CODE}",
                  file=out, flush=True)
            faulthandler.dump_traceback(file=out, all_threads=True)
            out.flush()
        finally:
            self._abort_group()
            os._exit(EXIT_CODE)

    @staticmethod
    def _abort_group(wait_s: float = 10.0):
        """Abort the default process group (peers blocked with us in a collective then fail fast);
        best effort, at most ``wait_s`` seconds."""
        def abort():
            try:
                import torch.distributed as dist
                from torch.distributed import distributed_c10d as c10d

                if dist.is_initialized() and hasattr(c10d, "_abort_process_group"):
                    c10d._abort_process_group()
            except Exception:  # noqa: BLE001 - we exit next anyway
                pass

        t = threading.Thread(target=abort, daemon=True)
        t.start()
        t.join(wait_s)

    def arm(self, label: str, seconds: float):
        self.cancel()
        self.label = label
        self._timer = threading.Timer(seconds, self._fire, args=(label, seconds, time.perf_counter()))
        self._timer.daemon = True
        self._timer.start()
        fileno = getattr(self.stream, "fileno", None)
        try:
            faulthandler.dump_traceback_later(seconds + self.backstop_s, exit=True,
                                              file=self.stream if fileno else sys.stderr)
        except (ValueError, OSError, AttributeError):   # a stream without a file descriptor (tests)
            faulthandler.dump_traceback_later(seconds + self.backstop_s, exit=True)

    def cancel(self):
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        faulthandler.cancel_dump_traceback_later()

    @contextlib.contextmanager
    def limit(self, label: str, seconds: float):
        """Run the block under a wall-clock limit (``seconds <= 0``: no limit)."""
        if seconds <= 0:
            yield
            return
        self.arm(label, seconds)
        try:
            yield
        finally:
            self.cancel()
