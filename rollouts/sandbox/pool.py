"""`Sandbox`: a pool of sandboxed zygotes; submit runs, await verdicts.

One worker thread per zygote, one run at a time per zygote, so a solution that
kills its sandbox only ever takes its own run down: that run is scored `hack`
(or `oom`), the zygote is restarted, and the batch goes on.
"""

from __future__ import annotations

import asyncio
import os
import queue
import secrets
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future

from rollouts.sandbox.guest import wire
from rollouts.sandbox.launchers import Channel, Launcher, make_launcher
from rollouts.sandbox.types import STATUSES, Limits, RunRequest, RunResult

_HOST_GRACE_S = 5.0  # beyond the zygote's own deadline before we declare it stuck
_STOP = object()


def _result(status: str, req: RunRequest, message: str) -> RunResult:
    return RunResult(
        status=status, tests_passed=0, tests_total=len(req.cases), message=message
    )


class _Worker:
    """Owns one live channel (relaunched on demand) and turns replies into results."""

    def __init__(self, launcher: Launcher, limits: Limits):
        self.launcher, self.limits = launcher, limits
        self.channel: Channel | None = None
        self.image: str | None = None

    def _channel_for(self, image: str | None) -> Channel:
        if self.channel is not None and image != self.image:
            self.discard()  # per-task image: swap the container
        if self.channel is None:
            self.channel, self.image = self.launcher.launch(image), image
        return self.channel

    def discard(self, graceful: bool = False) -> None:
        if self.channel is not None:
            self.channel.close(graceful)
            self.channel = None

    def _start(self, req: RunRequest) -> Channel:
        """Send the run's spec; a sandbox that died while idle is replaced once."""
        spec = {"spec": req.spec(self.limits)}
        try:
            channel = self._channel_for(req.image)
            if not channel.alive():
                raise BrokenPipeError("sandbox exited while idle")
            channel.send(spec)
        except OSError:  # not this run's doing: nothing of it has run yet
            self.discard()
            channel = self._channel_for(req.image)
            channel.send(spec)
        return channel

    def run(self, req: RunRequest) -> RunResult:
        channel = self._start(req)
        oom_before = channel.oom_kills()
        nonce = secrets.token_hex(16)
        verdict = None
        try:
            channel.send(req.secret(nonce))
            reply = channel.recv(self.limits.wall_s + _HOST_GRACE_S)
            if isinstance(reply, dict) and reply.get("verdict_bytes"):
                verdict = channel.recv(_HOST_GRACE_S)  # relayed right after the reply
        except TimeoutError:
            self.discard()
            return _result(
                "timeout",
                req,
                "sandbox stopped responding; it was killed and restarted",
            )
        except (OSError, wire.FrameError):
            reply = None
        oom = channel.oom_kills() > oom_before
        if not isinstance(reply, dict):
            self.discard()
            if oom:
                return _result(
                    "oom", req, "memory limit exceeded; the sandbox was killed"
                )
            return _result("hack", req, "the sandbox process was killed during the run")
        if reply.get("recycle") or channel.leftover():
            self.discard()
        return self._judge(req, reply, verdict, nonce, oom)

    def _judge(
        self, req: RunRequest, reply: dict, verdict: object, nonce: str, oom: bool
    ) -> RunResult:
        if not isinstance(verdict, dict):
            status = "oom" if oom else ("timeout" if reply.get("timeout") else "hack")
            return _result(status, req, str(reply.get("reason", "no verdict")))
        if verdict.get("nonce") != nonce:
            return _result("hack", req, "verdict is missing the run's nonce (forged?)")
        status = verdict.get("status")
        if status == "killed":
            status = "oom" if oom else "hack"
        if status not in STATUSES:
            return _result("error", req, f"harness returned unknown status {status!r}")
        passed = int(verdict.get("tests_passed", 0))
        total = (
            int(verdict.get("tests_total", 0))
            if req.mode == "pytest"
            else len(req.cases)
        )
        if status == "passed" and passed != total:  # belt and braces: count them
            return _result("error", req, f"harness said passed with {passed}/{total}")
        return RunResult(
            status=status,
            tests_passed=passed if status in ("passed", "failed") else 0,
            tests_total=total,
            message=str(verdict.get("message", "")),
            output=str(verdict.get("output", "")),
            output_bytes=int(verdict.get("output_bytes", 0)),
            output_truncated=bool(verdict.get("output_truncated", False)),
            seconds=float(verdict.get("seconds", 0.0)),
        )


class Sandbox:
    """Run `RunRequest`s in isolated sandboxes, `workers` at a time.

        with Sandbox("bwrap", workers=2) as sb:
            results = sb.map(requests)      # blocking, in input order
            future = sb.submit(request)     # concurrent.futures.Future
            result = await sb.run(request)  # asyncio

    Sandboxes start lazily on the first run and are reused until closed.
    """

    def __init__(
        self,
        backend: str = "bwrap",
        workers: int | None = None,
        limits: Limits | None = None,
        **options,
    ):
        self.limits = limits or Limits()
        self.launcher = make_launcher(backend, self.limits, **options)
        self.backend = backend
        self.workers = workers or os.cpu_count() or 1
        self._queue: queue.Queue = queue.Queue()
        self._workers = [
            _Worker(self.launcher, self.limits) for _ in range(self.workers)
        ]
        self._threads = [
            threading.Thread(target=self._serve, args=(w,), daemon=True)
            for w in self._workers
        ]
        for t in self._threads:
            t.start()

    def _serve(self, worker: _Worker) -> None:
        try:
            while (item := self._queue.get()) is not _STOP:
                req, future = item
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    future.set_result(worker.run(req))
                except Exception as e:  # a launch failure must not strand the caller
                    worker.discard()
                    future.set_exception(e)
        finally:
            worker.discard(graceful=True)

    def submit(self, req: RunRequest) -> Future[RunResult]:
        future: Future[RunResult] = Future()
        self._queue.put((req, future))
        return future

    async def run(self, req: RunRequest) -> RunResult:
        return await asyncio.wrap_future(self.submit(req))

    def map(
        self,
        reqs: Iterable[RunRequest],
        on_result: Callable[[int, RunResult], None] | None = None,
    ) -> list[RunResult]:
        """Results in input order; `on_result(index, result)` fires as each completes."""
        futures = [self.submit(r) for r in reqs]
        if on_result:
            for i, f in enumerate(futures):
                f.add_done_callback(
                    lambda f, i=i: f.exception() is None and on_result(i, f.result())
                )
        return [f.result() for f in futures]

    def close(self) -> None:
        """Cancel runs not yet started, finish the running ones, stop every sandbox."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not _STOP:
                item[1].cancel()
        for _ in self._threads:
            self._queue.put(_STOP)
        for t in self._threads:
            t.join()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
