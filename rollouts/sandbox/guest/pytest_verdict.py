"""pytest plugin loaded into the solution process for repository tasks.

It streams collection and per-test outcomes to the grader. It runs next to the
solution's code, so the grader cross-checks what it reports against the test
functions it finds itself in the pristine test files (see `grader`).
"""

from __future__ import annotations

import socket

import wire


def outcome(report) -> str:
    """A test report's outcome, an expected failure told apart from a skip ("xfailed")."""
    return "xfailed" if report.skipped and hasattr(report, "wasxfail") else report.outcome


class Reporter:
    def __init__(self, sock: socket.socket):
        self.sock = sock

    def pytest_collection_finish(self, session) -> None:
        wire.send_sock(
            self.sock, ["collected", [item.nodeid for item in session.items]]
        )

    def pytest_collectreport(self, report) -> None:
        if report.skipped:  # a module skipped as it was collected (`importorskip`)
            wire.send_sock(self.sock, ["report", report.nodeid, "collect", "skipped", ""])
        elif report.failed:  # a module that did not import: its tests fail (see grader)
            detail = str(report.longrepr)[-1000:]
            wire.send_sock(self.sock, ["report", report.nodeid, "collect", "failed", detail])

    def pytest_runtest_logreport(self, report) -> None:
        if report.when == "call" or report.outcome != "passed":
            detail = str(report.longrepr)[-1000:] if report.failed else ""
            wire.send_sock(
                self.sock,
                ["report", report.nodeid, report.when, outcome(report), detail],
            )
