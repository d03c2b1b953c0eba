"""Asynchronous collectives: what ``dqcoll.allreduce(..., async_op=True)`` returns, run on a
per-communicator worker thread (the codec work is host-driven); docs/gpu_transport.md,
"async_op=True".
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .interop import caller_stream

__all__ = ["CollectiveHandle", "drain", "shutdown", "submit"]


class CollectiveHandle:
    """The pending result of one asynchronous collective."""

    def __init__(self, future: concurrent.futures.Future[Any], result: Any, buf: Any,
                 what: str) -> None:
        self._future = future
        self._result = result
        self._buf = buf  # decides which stream waits (torch's or CuPy's current stream)
        self.what = what

    def is_completed(self) -> bool:
        """True once the collective is done: queued work finished on the device too."""
        if not self._future.done():
            return False
        done = None if self._future.exception() is not None else self._future.result()
        return done is None or bool(done.query())

    def wait(self, timeout_s: float | None = None) -> Any:
        """Block until the collective is queued (CUDA) or done (CPU); return its output buffer.

        On CUDA the caller's current stream then waits for the collective's last kernel. Raises
        the collective's error, if any; ``timeout_s`` bounds the host wait (``TimeoutError``).
        """
        # wait, then look: an except TimeoutError around result() would catch the call's own
        finished, _ = concurrent.futures.wait([self._future], timeout=timeout_s)
        if not finished:
            raise TimeoutError(
                f"{self.what}: not finished after waiting {timeout_s:g} s on the host")
        done = self._future.result()  # raises the collective's error, if it had one
        if done is not None:  # a CUDA buffer: its caller's stream
            caller_stream(self._buf).wait_event(done)
        return self._result

    def add_done_callback(self, fn: Callable[[concurrent.futures.Future[Any]], None]) -> None:
        """Call ``fn(future)`` on the worker thread once the collective has run on the host.
        ``future.exception()`` is its error or None; on CUDA ``future.result()`` is the event
        recorded after its last kernel."""
        self._future.add_done_callback(fn)

    def __repr__(self) -> str:
        state = "completed" if self.is_completed() else "pending"
        return f"CollectiveHandle({self.what!r}, {state})"


class Worker:
    """A daemon thread that runs its jobs in issue order (a communicator's asynchronous
    collectives; the executor's exchanges)."""

    def __init__(self, name: str) -> None:
        self.jobs: queue.SimpleQueue[
            tuple[Callable[[], Any], concurrent.futures.Future[Any]] | None] = queue.SimpleQueue()
        self.last: concurrent.futures.Future[Any] | None = None
        self.streams: dict[int, Any] = {}  # CUDA device index -> the worker's side stream
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    def _loop(self) -> None:
        # a None job ends the thread: the communicator was closed or collected
        while (job := self.jobs.get()) is not None:
            fn, future = job
            del job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # handed to the handle's wait()
                    future.set_exception(exc)
            del fn, future  # keep no reference to the communicator between jobs

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self.jobs.put((fn, future))
        self.last = future
        return future


_WORKERS: weakref.WeakKeyDictionary[Any, Worker] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def _worker(comm: Any) -> Worker:
    with _LOCK:
        worker = _WORKERS.get(comm)
        if worker is None:
            worker = _WORKERS[comm] = Worker(f"dqcoll-async rank {comm.rank}")
            weakref.finalize(comm, worker.jobs.put, None)  # garbage collection ends the thread too
        return worker


def shutdown(comm: Any) -> None:
    """End ``comm``'s worker thread (if it has one) after its queued jobs."""
    with _LOCK:
        worker = _WORKERS.pop(comm, None)
    if worker is not None:
        worker.jobs.put(None)


def drain(comm: Any, timeout_s: float | None = None) -> bool:
    """Wait until every asynchronous collective issued on ``comm`` so far has run; False if
    ``timeout_s`` passed first."""
    worker = _WORKERS.get(comm)
    if worker is not None and worker.last is not None:
        done, _ = concurrent.futures.wait([worker.last], timeout=timeout_s)
        return bool(done)
    return True


def submit(comm: Any, run: Callable[[], None], *, buf: Any, result: Any,
           what: str) -> CollectiveHandle:
    """Run ``run()`` (one whole collective on ``comm``) on the communicator's worker; on a
    closed or dead communicator the handle holds the error at once."""
    if comm.closed or comm.dead is not None:
        try:
            with comm.in_flight(what):  # raises the closed / dead communicator's error
                pass
        except Exception as exc:
            future: concurrent.futures.Future[Any] = concurrent.futures.Future()
            future.set_exception(exc)
            return CollectiveHandle(future, result, buf, what)
    worker = _worker(comm)
    stream = caller_stream(buf)
    if stream is None:
        return CollectiveHandle(worker.submit(run), result, buf, what)
    ready = torch.cuda.Event()
    ready.record(stream)
    index = stream.device.index  # a stream's device always has its index

    def job() -> Any:
        if index not in worker.streams:
            worker.streams[index] = torch.cuda.Stream(device=index)
        side = worker.streams[index]
        side.wait_event(ready)
        with torch.cuda.stream(side):
            run()
        done = torch.cuda.Event()
        done.record(side)
        return done

    return CollectiveHandle(worker.submit(job), result, buf, what)
