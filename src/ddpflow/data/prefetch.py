"""Work on the next batches while the training step runs on the current one.

`Ahead(source, work, device, depth)` iterates `work(item)` for the items of `source`, in
their order, with `work` running in a background thread up to `depth` items ahead of the
one the caller holds: the GPU JPEG decode (nvJPEG, loaders.py) of batch k+1 overlaps the
training step of batch k instead of running in series with it. On a GPU the work runs on a
side CUDA stream; the caller's stream waits for that batch's event (no host
synchronisation), and its tensors are marked as used on the caller's stream, so the caching
allocator does not hand their memory to the next batch while the step still reads it.

An exception in `source` or `work` is raised to the caller at that item's place, after the
batches before it. Closing the iterator early (a `break`, a stop signal) stops the thread
after the item it works on. depth 0 is the plain loop: no thread, no stream.
"""

from __future__ import annotations

import queue
import threading

import torch

_END = object()


class Ahead:
    def __init__(self, source, work, device: torch.device, depth: int = 2):
        self.source, self.work, self.device, self.depth = source, work, device, depth
        self.cuda = device.type == "cuda"
        self.thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._slots = threading.Semaphore(max(depth, 1))
        self._ready: queue.Queue = queue.Queue()

    def __iter__(self):
        if self.depth <= 0:
            yield from (self.work(item) for item in self.source)
            return
        self.thread = threading.Thread(target=self._run, name="ddpflow-prefetch", daemon=True)
        self.thread.start()
        try:
            while True:
                kind, out, ready = self._ready.get()
                self._slots.release()  # taken: the thread may start one more
                if kind is _END:
                    return
                if kind == "error":
                    raise out
                if ready is not None:
                    wait_ready(out, ready, self.device)
                yield out
        finally:
            self.close()

    def close(self) -> None:
        self._stop.set()
        self._slots.release()  # a thread waiting for a slot sees the stop

    def _run(self) -> None:
        stream = side_stream(self.device) if self.cuda else None
        try:
            for item in self.source:
                self._slots.acquire()
                if self._stop.is_set():
                    return
                if stream is None:
                    self._ready.put(("batch", self.work(item), None))
                    continue
                with stream_context(stream):
                    out = self.work(item)
                    self._ready.put(("batch", out, mark_ready(stream)))
        except BaseException as e:  # noqa: BLE001 - handed to the caller at this item
            self._ready.put(("error", e, None))
            return
        self._ready.put((_END, None, None))


# the CUDA calls, apart: tests stand them in on a CPU machine
def side_stream(device: torch.device):
    if device.index is not None:
        torch.cuda.set_device(device)  # the current device is per thread
    return torch.cuda.Stream(device)


def stream_context(stream):
    return torch.cuda.stream(stream)


def mark_ready(stream):
    """An event recorded on `stream` after the batch's work was queued on it."""
    event = torch.cuda.Event()
    event.record(stream)
    return event


def wait_ready(out, event, device: torch.device) -> None:
    """The caller's stream waits for the batch; its tensors are marked as used there."""
    current = torch.cuda.current_stream(device)
    current.wait_event(event)
    for t in tensors(out):
        if t.device.type == "cuda":
            t.record_stream(current)


def tensors(out):
    """The tensors in a batch (nested tuples and lists)."""
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for o in out:
            yield from tensors(o)
