"""The loop's watchdog. The loop runs each engine call (a job's admission: its chat template, its
tokens, its grammar; a step) inside `LoopWatch.engine`; a call that runs past `stall_limit` means
the worker is hung, whatever holds it, and nothing inside the loop can end the call. So this
thread, beside the heartbeat's:

1. marks the job(s) of that call in their job hashes (`fleet_hung` += this worker, only while this
   worker owns the job): a job that has now stopped two workers is poison, and the reaper fails it
   instead of handing it to a third (worker/liveness/reaper.py);
2. stops the heartbeat and removes the worker's status key (it claims nothing more), hands back
   every job it holds through the reaper's rules, and takes it off RQ's registry;
3. exits the process at once (os._exit: the stuck thread cannot be joined) with EXIT_HUNG, for its
   supervisor (PM2, supervisord, systemd, Kubernetes: all restart a worker that exits) to start
   again.

A stop signal reaches a stuck loop the same way: the handler runs, but the loop never looks; once
the drain's grace is over with the loop still in one call, the watchdog leaves (without the marks
when the call is younger than the limit). A hang that holds the GIL (Python's own code running in
C on a huge value: what the chat-template budget keeps templates from) stops this thread too;
for admissions, where a template runs, a C timer (faulthandler) ends the process at twice the
limit, and its jobs are handed back as after any death.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
import traceback
from contextlib import suppress
from typing import TYPE_CHECKING

from backends.contract.keys import HUNG_FIELD, OWNER_FIELD, job_key, worker_key
from backends.contract.lua import lua_script
from backends.contract.retry import OUTAGE_ERRORS
from worker.liveness.heartbeat import clear_status
from worker.serving.stall import EngineCall

if TYPE_CHECKING:
    from worker.liveness.heartbeat import Heartbeat

log = logging.getLogger("fleet.watchdog")
EXIT_HUNG = 70  # EX_SOFTWARE: an internal error; every supervisor restarts on it

MARK_HUNG = lua_script("worker.liveness", "mark_hung.lua")  # a job's hung list, while this worker owns it


class Watchdog(threading.Thread):
    def __init__(self, hb: Heartbeat) -> None:
        super().__init__(name="fleet-watchdog", daemon=True)
        self.hb = hb
        self.fw = hb.fw
        self.limit = self.fw.settings.stall_limit
        self._halt = threading.Event()
        self.fw.watch.backstop = 2 * self.limit

    def halt(self) -> None:
        self._halt.set()

    def run(self) -> None:
        while not self._halt.wait(min(1.0, self.limit / 4)):
            stuck = self.stuck(time.monotonic())
            if stuck is not None:
                self.leave(*stuck)

    def stuck(self, now: float) -> tuple[EngineCall, float, bool] | None:
        """(the call, its seconds, hung: past the limit) when the worker must go; None while not."""
        call = self.fw.watch.call
        if call is None:
            return None
        took = now - call.started
        if took > self.limit:
            return call, took, True
        if self.fw.drain_overdue(now):  # stopped, and the drain's grace spent inside one call
            return call, took, False
        return None

    def leave(self, call: EngineCall, took: float, hung: bool) -> None:
        fw = self.fw
        why = (f"worker {fw.name} hung: its loop was stuck {took:.0f}s {call.what} (stall_limit "
               f"{self.limit:g}s) and it was restarted") if hung else \
            f"worker {fw.name} was stopped while its loop was stuck {took:.0f}s {call.what}"
        log.critical("%s; jobs of that call: %s; the loop was at:\n%s", why, ", ".join(call.jobs()) or "none",
                     _stack_of_main())
        faulthandler.cancel_dump_traceback_later()  # the C timer must not cut the hand-back short
        try:
            self.hb.halt()  # no beat may bring the status key back
            with suppress(*OUTAGE_ERRORS):  # Redis away: the key expires, another reaper hands back
                if hung:
                    for job_id in call.jobs():
                        fw.redis.eval(MARK_HUNG, 1, job_key(job_id), HUNG_FIELD, OWNER_FIELD, fw.name)
                fw.redis.delete(worker_key(fw.name))  # taken for dead at once: it claims nothing more
                n = self.hb.reaper.reap_worker(fw.name, why=why)
                log.critical("handed back %d jobs; exiting (%d) for the supervisor to restart", n, EXIT_HUNG)
                fw.claims.forget()
                self.hb.rq_worker.register_death()
                clear_status(fw.redis, fw.name)
        except Exception:
            log.exception("leaving the fleet failed; exiting all the same")
        finally:
            for stream in (sys.stdout, sys.stderr):
                with suppress(Exception):
                    stream.flush()
            os._exit(EXIT_HUNG)


def _stack_of_main() -> str:
    frame = sys._current_frames().get(threading.main_thread().ident or 0)
    return "".join(traceback.format_stack(frame)[-12:]) if frame is not None else "(unknown)"
