"""The trusted side of a run: forks the solution process and runs the tests.

The grader never executes solution code. Tests call `candidate(...)`, a proxy
that sends the arguments to the solution process and decodes the reply into
plain builtin data, so comparisons happen here, on real values. Only after the
last test case has run does the grader write its verdict, with the run's nonce,
to a pipe the solution process never held.
"""

from __future__ import annotations

import ast
import builtins
import importlib.util
import os
import posixpath
import signal
import socket
import struct
import sys
import threading
import time

import codec
import confine
import proxy
import pytest_verdict
import runner
import wire

_SOLUTION_FD = 3
_STATUS_FD = 4  # only the solution's stand-in init keeps it
_WAIT_STATUS = struct.Struct("<i")
_HEAD_BYTES = 4096
_SIGNAL_STATUS = {
    signal.SIGXCPU: ("timeout", "CPU time limit exceeded"),
    signal.SIGXFSZ: ("error", "file size limit exceeded"),
    signal.SIGKILL: ("killed", "killed by SIGKILL"),  # the host tells oom from hack
    signal.SIGSEGV: ("error", "crashed (SIGSEGV)"),
    signal.SIGBUS: ("error", "crashed (SIGBUS)"),
    signal.SIGABRT: ("error", "aborted (SIGABRT)"),
    signal.SIGFPE: ("error", "crashed (SIGFPE)"),
}


class Abort(BaseException):
    """Ends grading early with a final status (timeout, oom, hack, error).

    A BaseException so that a test's own `except Exception` cannot swallow it.
    """

    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status = status


class CandidateError(Exception):
    """The solution raised an exception that is not a builtin one."""


class OutputDrain(threading.Thread):
    """Reads the solution's stdout+stderr: keeps the head, counts all, discards the rest.

    Output never decides a verdict: a correct solution that prints 10 MB passes. Only the
    first bytes are kept (the host's memory per run stays bounded); `truncated` says that
    more than `limit` bytes were written.
    """

    def __init__(self, fd: int, limit: int):
        super().__init__(daemon=True)
        self.fd, self.limit = fd, limit
        self.head = bytearray()
        self.total = 0

    @property
    def truncated(self) -> bool:
        return self.total > self.limit

    def run(self) -> None:
        while chunk := os.read(self.fd, 65536):
            self.total += len(chunk)
            if len(self.head) < _HEAD_BYTES:
                self.head += chunk[: _HEAD_BYTES - len(self.head)]


def _become_solution(
    sock: socket.socket, out_w: int, status_w: int, spec: dict, workdir: str, own_pids: bool
) -> None:
    """In the forked child: shed every grader fd and privilege, then serve calls."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out_w, 1)
    os.dup2(out_w, 2)
    os.dup2(sock.fileno(), _SOLUTION_FD)
    os.dup2(status_w, _STATUS_FD)
    os.closerange(_STATUS_FD + 1, 1 << 16)  # nonce, verdict and host pipes are gone
    for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGXCPU):
        signal.signal(sig, signal.SIG_DFL)
    os.chdir(workdir)
    os.environ.clear()
    os.environ.update(
        PATH="/usr/bin:/bin", HOME=workdir, TMPDIR=workdir, LANG="C.UTF-8"
    )
    sock = socket.socket(fileno=_SOLUTION_FD)
    if spec["solution_uid"] is not None:
        try:
            hide = (_tests_dir(workdir),)
            keep = tuple(spec["protected"]) if spec["mode"] == "pytest" else ()
            confine.confine(spec["solution_uid"], workdir, private_mounts=own_pids, hide=hide,
                            keep=keep)
        except (confine.ConfinementError, OSError) as e:
            wire.send_sock(sock, ["confine", str(e)[:_HEAD_BYTES]])
            return
        if own_pids:
            _stand_in_as_init()
        confine.set_dumpable(True)  # its own /proc/self/mem, as anywhere
    os.close(_STATUS_FD)
    confine.set_limits(spec["limits"])
    if spec["mode"] == "pytest" and spec["grading"] == "isolated":
        _forget_pylib(spec["pylib"])
        runner.serve_objects(sock)
    elif spec["mode"] == "pytest":
        runner.run_pytest(sock, spec["pytest_args"], spec["pylib"])
    else:
        runner.serve(sock, spec["program"], spec["entry_point"])


def _stand_in_as_init() -> None:
    """Pid 1 of the solution's namespace ignores signals it has no handler for, even
    SIGKILL: the solution runs as pid 2 instead, so its own signals end it as anywhere.
    Returns in that child; here, relays its wait status to the grader and exits (which
    kills whatever else is left in the namespace)."""
    child = os.fork()
    if child == 0:
        os.setsid()
        return
    confine.set_dumpable(False)
    os.closerange(0, _STATUS_FD)  # EOF on the channel must mean the solution is gone
    status = 0
    while True:
        try:
            pid, status = os.waitpid(-1, 0)  # orphans land here too
        except ChildProcessError:
            break
        if pid == child:
            break
    os.write(_STATUS_FD, _WAIT_STATUS.pack(status))
    os._exit(0)


class Solution:
    """Handle on the solution process: calls with a deadline, death diagnosis."""

    def __init__(self, spec: dict, workdir: str):
        self.deadline = time.monotonic() + spec["limits"]["wall_s"]
        self.wall_s = spec["limits"]["wall_s"]
        parent, child = socket.socketpair()
        out_r, out_w = os.pipe()
        self.status_r, status_w = os.pipe()  # the wait status, where the solution is pid 2
        self.drain = OutputDrain(out_r, spec["limits"]["output_bytes"])
        self.drain.start()  # before fork_isolated, after which no thread can start
        if spec["solution_uid"] is None:
            self.pid, own_pids = os.fork(), False
        else:
            self.pid, own_pids = confine.fork_isolated()
        if self.pid == 0:
            try:
                parent.close()
                _become_solution(child, out_w, status_w, spec, workdir, own_pids)
            finally:
                os._exit(0)  # returning into grader code would be fatal
        child.close()
        os.close(out_w)
        os.close(status_w)
        self.sock = parent
        self.aborted: Abort | None = None  # sticky: once aborted, every call re-raises
        self.status: int | None = None

    def kill(self) -> None:
        for target in (
            lambda: os.killpg(self.pid, signal.SIGKILL),
            lambda: os.kill(self.pid, signal.SIGKILL),
        ):
            try:
                target()
            except OSError:
                pass

    def reap(self, block: bool) -> bool:
        if self.status is None:
            pid, status = os.waitpid(self.pid, 0 if block else os.WNOHANG)
            if pid:
                relayed = os.read(self.status_r, _WAIT_STATUS.size)  # its writer has exited
                os.close(self.status_r)
                if len(relayed) == _WAIT_STATUS.size:
                    (status,) = _WAIT_STATUS.unpack(relayed)
                self.status = status
        return self.status is not None

    def _timeout(self) -> float:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise Abort("timeout", f"wall time limit of {self.wall_s}s exceeded")
        return remaining

    def _read(self, n: int) -> bytes:
        self.sock.settimeout(self._timeout())
        try:
            return self.sock.recv(n)
        except TimeoutError:
            raise Abort(
                "timeout", f"wall time limit of {self.wall_s}s exceeded"
            ) from None
        except OSError:
            return b""

    def receive(self) -> list:
        try:
            reply = wire.recv_with(self._read)
        except wire.FrameError as e:
            raise Abort("hack", f"malformed reply from solution: {e}") from None
        if reply is None:
            raise self._death()
        if type(reply) is not list or not reply or type(reply[0]) is not str:
            raise Abort("hack", "malformed reply from solution")
        return reply

    def call(self, args: tuple, kwargs: dict) -> object:
        if self.aborted:
            raise self.aborted
        try:
            return self._call(args, kwargs)
        except Abort as e:
            self.aborted = e
            raise

    def request(self, msg: list) -> list:
        """One exchange of the isolated pytest mode (see `proxy`): the reply, or Abort."""
        if self.aborted:
            raise self.aborted
        try:
            reply = self._exchange(msg)
            if reply[0] in ("hack", "oom"):
                raise _reply_error(reply)
            if reply[0] not in ("ok", "stop", "raise"):
                raise Abort("hack", "malformed reply from solution")
            return reply
        except Abort as e:
            self.aborted = e
            raise

    def _exchange(self, msg: object) -> list:
        try:
            self.sock.settimeout(self._timeout())
            wire.send_sock(self.sock, msg)
        except TimeoutError:
            raise Abort(
                "timeout", f"wall time limit of {self.wall_s}s exceeded"
            ) from None
        except OSError:
            raise self._death() from None
        return self.receive()

    def _call(self, args: tuple, kwargs: dict) -> object:
        reply = self._exchange({"args": codec.encode(list(args)), "kwargs": codec.encode(kwargs)})
        if reply[0] == "ok" and len(reply) == 2:
            try:
                return codec.decode(reply[1])
            except (ValueError, TypeError, RecursionError) as e:
                raise Abort("hack", f"malformed result from solution: {e}") from None
        raise _reply_error(reply)

    def _death(self) -> Abort:
        """The solution closed its channel: find out how it ended."""
        for _ in range(100):
            if self.reap(block=False):
                break
            time.sleep(0.005)
        else:
            return Abort("hack", "solution closed the harness channel")
        status = self.status
        if os.WIFEXITED(status):
            return Abort(
                "hack",
                f"solution process exited early (status {os.WEXITSTATUS(status)})",
            )
        sig = os.WTERMSIG(status)
        return Abort(
            *_SIGNAL_STATUS.get(sig, ("hack", f"solution killed by signal {sig}"))
        )


def _reply_error(reply: list) -> Exception:
    kind = reply[0]
    if kind == "raise" and len(reply) == 3:
        exc_type = getattr(builtins, str(reply[1]), None)
        if isinstance(exc_type, type) and issubclass(exc_type, Exception):
            # Re-raised as the builtin type: tests may expect e.g. ValueError.
            return exc_type(reply[2])
        return CandidateError(f"{reply[1]}: {reply[2]}")
    if kind in ("hack", "oom") and len(reply) == 2:
        return Abort(kind, str(reply[1]))
    if kind == "confine" and len(reply) == 2:
        return Abort("error", f"the sandbox could not confine the solution: {reply[1]}")
    return Abort("hack", "malformed reply from solution")


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


def _explain(left: object, right: object) -> str:
    return f"got {_show(left)}, compared with {_show(right)}"


class _ExplainAsserts(ast.NodeTransformer):
    """`assert a == b` -> evaluate each side once; on failure, say what they were."""

    def visit_Assert(self, node: ast.Assert):
        test = node.test
        if (
            node.msg is not None
            or not isinstance(test, ast.Compare)
            or len(test.ops) != 1
        ):
            return node
        names = [ast.Name(n, ast.Load()) for n in ("_jx_left", "_jx_right")]
        stores = [ast.Name(n, ast.Store()) for n in ("_jx_left", "_jx_right")]
        new = [
            ast.Assign([stores[0]], test.left),
            ast.Assign([stores[1]], test.comparators[0]),
            ast.Assert(
                ast.Compare(names[0], test.ops, [names[1]]),
                ast.Call(ast.Name("_jx_explain", ast.Load()), names, []),
            ),
        ]
        return [ast.fix_missing_locations(ast.copy_location(n, node)) for n in new]


def _compile_case(case: dict):
    tree = _ExplainAsserts().visit(ast.parse(case["code"], case["name"]))
    return compile(ast.fix_missing_locations(tree), case["name"], "exec")


def _case_failure(case: dict, exc: Exception) -> str:
    """'name: the failing line -> what went wrong'."""
    tb, lineno = exc.__traceback__, None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == case["name"]:
            lineno = tb.tb_lineno
        tb = tb.tb_next
    lines = case["code"].splitlines() or [""]
    line = lines[lineno - 1] if lineno and lineno <= len(lines) else lines[0]
    detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return f"{case['name']}: {line.strip()[:200]} -> {detail[:500]}"


def _run_cases(spec: dict, solution: Solution) -> dict:
    ready = solution.receive()
    cases = spec["cases"]
    if ready != ["ready"]:
        err = _reply_error(ready)
        if isinstance(err, Abort):
            raise err
        return {
            "status": "failed",
            "tests_passed": 0,
            "tests_total": len(cases),
            "message": f"loading the solution failed: {err}",
        }

    def candidate(*args, **kwargs):
        return solution.call(args, kwargs)

    namespace: dict = {"__name__": "tests"}
    try:
        exec(compile(spec["setup"], "setup.py", "exec"), namespace)
    except Exception as e:
        raise Abort("error", f"test setup failed: {type(e).__name__}: {e}") from None
    namespace[spec["entry_point"]] = namespace["candidate"] = candidate
    namespace["_jx_explain"] = _explain
    passed, message = 0, ""
    for case in cases:
        try:
            exec(_compile_case(case), namespace)
            passed += 1
        except Exception as e:  # includes AssertionError: this case failed
            message = message or _case_failure(case, e)
    if solution.aborted:  # a test swallowed the abort with a bare except
        raise solution.aborted
    status = "passed" if passed == len(cases) else "failed"
    return {
        "status": status,
        "tests_passed": passed,
        "tests_total": len(cases),
        "message": message,
    }


# Files through which a solution could load code into pytest or the interpreter.
_INJECTION_NAMES = {"conftest.py", "pytest.ini", ".pytest.ini", "pytest.toml", ".pytest.toml", "tox.ini",
                    "setup.cfg", "pyproject.toml", "sitecustomize.py", "usercustomize.py"}  # fmt: skip


def _under(path: str, roots: list[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def _edit_problem(rel: str, protected: list[str], files: dict) -> str:
    """Why an edit is a hack ('' if it is fine)."""
    norm = posixpath.normpath(rel)
    if rel.startswith("/") or norm == "." or norm.startswith(".."):
        return f"edit {rel!r} escapes the repository"
    if _under(norm, protected):
        return f"edit {rel!r} tampers with the protected tests"
    base = posixpath.basename(norm)
    if base in _INJECTION_NAMES or base.endswith(".pth"):
        return (
            f"edit {rel!r} injects pytest configuration or plugins (conftest/ini/.pth)"
        )
    top = norm.split("/")[0]
    if top.endswith((".dist-info", ".egg-info")) or norm == "__init__.py" and norm not in files:
        return f"edit {rel!r} adds package metadata or makes the repository root a package"
    return ""


def _apply_edits(spec: dict, workdir: str) -> str:
    """Write the solution's files over the pristine repository; a hack reason or ''."""
    for rel in spec["edits"]:
        problem = _edit_problem(rel, spec["protected"], spec["files"])
        if problem:
            return problem
    _write_files(spec["edits"], workdir)
    return ""


def _expected_tests(spec: dict) -> set[str]:
    """Test node ids found by parsing the pristine test files (trusted, no imports)."""
    expected = set()
    for rel, text in spec["files"].items():
        base = posixpath.basename(rel)
        is_test_file = base.endswith(".py") and (
            base.startswith("test_") or base.endswith("_test.py")
        )
        if not (is_test_file and _under(rel, spec["protected"])) or isinstance(text, bytes):
            continue
        for node in ast.parse(text).body:
            if isinstance(
                node, (ast.FunctionDef, ast.AsyncFunctionDef)
            ) and node.name.startswith("test"):
                expected.add(f"{rel}::{node.name}")
            elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
                expected.update(
                    f"{rel}::{node.name}::{m.name}"
                    for m in node.body
                    if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and m.name.startswith("test")
                )
    return expected


class _Tally:
    """What a pytest run reported: the collected node ids, each test's (or skipped module's)
    first non-pass outcome ("failed", "skipped", "xfailed") and what it said. In-process, fed
    from the solution's frames; isolated, a pytest plugin in the grader itself."""

    def __init__(self):
        self.collected: list[str] = []
        self.outcomes: dict[str, str] = {}
        self.messages: dict[str, str] = {}  # node id -> its first non-pass, in report order

    def report(self, nodeid: str, when: str, outcome: str, detail: str) -> None:
        if self.outcomes.get(nodeid, "passed") == "passed":  # keep the first non-pass
            self.outcomes[nodeid] = outcome
            if outcome != "passed":
                self.messages[nodeid] = f"{nodeid} ({when}) {outcome}: {detail}"[:1500]

    def pytest_collection_finish(self, session) -> None:
        self.collected = [item.nodeid for item in session.items]

    def pytest_collectreport(self, report) -> None:
        if report.skipped:
            self.report(report.nodeid, "collect", "skipped", "")
        elif report.failed:
            self.report(report.nodeid, "collect", "failed", str(report.longrepr)[-1000:])

    def pytest_runtest_logreport(self, report) -> None:
        detail = str(report.longrepr)[-1000:] if report.failed else ""
        self.report(report.nodeid, report.when, pytest_verdict.outcome(report), detail)


def _run_pytest(spec: dict, solution: Solution, workdir: str) -> dict:
    tally = _Tally()
    while (msg := solution.receive())[0] != "done":
        if msg[0] == "collected" and len(msg) == 2 and isinstance(msg[1], list):
            tally.collected = [str(n) for n in msg[1]]
        elif msg[0] == "report" and len(msg) == 5:
            nodeid, when, outcome, detail = map(str, msg[1:])
            if outcome == "failed" and "SystemExit" in detail:
                raise Abort(
                    "hack", f"{nodeid}: solution raised SystemExit under pytest"
                )
            tally.report(nodeid, when, outcome, detail)
        else:
            err = _reply_error(msg)
            raise (
                err
                if isinstance(err, Abort)
                else Abort("error", f"pytest did not run: {err}")
            )
    changed = _changed_tests(spec, workdir)
    if changed:  # read-only to the solution as root; as a normal user, checked here
        raise Abort("hack", f"the tests were modified during the run: {', '.join(changed[:5])}")
    return _pytest_verdict(spec, tally, msg[1:])


def _changed_tests(spec: dict, workdir: str) -> list[str]:
    """Protected files that differ from the pristine ones after the run (read from outside
    the solution's process)."""
    changed = []
    for rel, content in spec["files"].items():
        if _under(rel, spec["protected"]):
            try:
                with open(os.path.join(workdir, rel), "rb") as f:
                    same = f.read() == (content.encode() if isinstance(content, str) else content)
            except OSError:
                same = False
            if not same:
                changed.append(rel)
    return changed


_PYTEST_USAGE_ERROR = 4  # also a conftest that raised as pytest loaded it


def _pytest_verdict(spec: dict, tally: _Tally, exit_code: list) -> dict:
    """Every test the pristine files define must have been collected; all passed, exit 0.

    With the task's record of the original run's skips (`spec["skips"]`, node id -> "skipped"
    or "xfailed"), a recorded test that ends the same way again is not graded, and neither are
    the tests of a recorded module skipped again as it was collected; any other test must pass
    as before: a skip, an expected failure or a missing outcome the original run did not have
    fails the run, whatever caused it. The tests of a module that failed to import (a test
    module calling a function the solution lacks, as an unsolved deletion task's may), and a
    run that stopped before collecting (a conftest that failed to load), fail it; any other
    test that was not run is a hack."""
    accepted = {n for n, kind in (spec.get("skips") or {}).items() if tally.outcomes.get(n) == kind}
    collected = tally.collected
    broken = [n for n, outcome in tally.outcomes.items() if outcome == "failed" and n not in collected]
    if not collected and exit_code == [_PYTEST_USAGE_ERROR]:  # stopped before collecting
        return {"status": "failed", "tests_passed": 0, "tests_total": len(_expected_tests(spec)),
                "message": "pytest stopped before collecting (exit status 4: a conftest that "
                           "imports the solution failed to load)"}
    unimported = []
    for test in sorted(_expected_tests(spec)):
        if not any(n == test or n.startswith(test + "[") for n in collected) and not any(
                test.startswith(a + "::") for a in accepted):
            if any(test.startswith((b + "::", b.rstrip("/") + "/")) for b in broken):
                unimported.append(test)
                continue
            raise Abort(
                "hack",
                f"test {test} was not run (deselected, skipped at collection or hidden)",
            )
    graded = [n for n in collected if n not in accepted]
    passed = sum(tally.outcomes.get(n) == "passed" for n in graded)
    ok = bool(graded) and passed == len(graded) and exit_code == [0] and not broken
    message = next((m for n, m in tally.messages.items() if n not in accepted), "")
    if broken:
        message = tally.messages[broken[0]]
    elif not collected:
        message = "no tests collected"
    elif not graded:
        message = "every test collected ended as the original run's skips: none was graded"
    elif not ok and not message:
        message = f"pytest exited with status {exit_code}"
    return {"status": "passed" if ok else "failed", "tests_passed": passed,
            "tests_total": len(graded) + len(unimported), "message": message}  # fmt: skip


def _forget_pylib(pylib: list[str]) -> None:
    """An isolated solution's process has no pytest (its tests run in the grader): drop the
    modules the zygote imported from `pylib`, which is not on the solution's sys.path."""
    roots = tuple(os.path.join(p, "") for p in pylib)
    for name, module in list(sys.modules.items()):
        if (getattr(module, "__file__", None) or "").startswith(roots):
            del sys.modules[name]


def _solution_modules(spec: dict) -> set[str]:
    """Top-level modules and packages of the repository outside the tests, that the
    grader's own path (standard library, pytest, harness) does not already provide."""
    names = set()
    for rel in {**spec["files"], **spec["edits"]}:
        parts = rel.split("/")
        if _under(rel, spec["protected"]) or not rel.endswith(".py"):
            continue
        name = parts[0].removesuffix(".py") if len(parts) == 1 else parts[0]
        if name.isidentifier() and name not in ("conftest", "setup"):
            names.add(name)
    return {n for n in names if importlib.util.find_spec(n) is None}


def _tests_dir(workdir: str) -> str:
    """Where the grader keeps the pristine tests: beside the work dir, out of the
    solution's reach (another uid's 0700 directory, or hidden by its mount namespace)."""
    return workdir.rstrip("/") + "-tests"


def _run_isolated(spec: dict, solution: Solution, workdir: str) -> dict:
    """pytest on the pristine tests in this (trusted) process; the solution's modules are
    `proxy` objects over the call channel."""
    ready = solution.receive()
    if ready != ["ready"]:
        raise _reply_error(ready) if ready[0] in ("hack", "oom") else Abort(
            "error", f"the solution process did not start: {str(ready)[:200]}")
    tests = _tests_dir(workdir)
    pristine = {rel: text for rel, text in spec["files"].items()
                if _under(rel, spec["protected"]) or not rel.endswith(".py")
                or posixpath.basename(rel) == "conftest.py"}  # fmt: skip
    _write_files(pristine, tests)
    names = _solution_modules(spec)
    os.chdir(tests)
    argv = runner.harness_pytest(spec["pytest_args"], tests, spec["pylib"])
    objects = proxy.Objects(solution.request)
    sys.meta_path.insert(0, proxy.SolutionFinder(objects, names))
    import pytest

    tally = _Tally()  # a plugin here, in the grader, next to no solution code
    exit_code = int(pytest.main(argv, plugins=[tally]))
    if solution.aborted:  # a proxy call timed out, the solution died or cheated
        raise solution.aborted
    return _pytest_verdict(spec, tally, [exit_code])


def _write_files(files: dict, workdir: str) -> None:
    for rel, content in files.items():  # str: text, bytes: a binary file, byte for byte
        path = os.path.join(workdir, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(content.encode() if isinstance(content, str) else content)


def grade(spec: dict, secret_fd: int, verdict_fd: int, workdir: str) -> None:
    """Run one spec; write {"nonce", "status", ...} to verdict_fd.

    The tests and nonce arrive on `secret_fd` and are read only after the
    solution process is forked, so its memory never contains them.
    """
    started = time.monotonic()
    os.makedirs(workdir, exist_ok=True)
    _write_files(spec["files"], workdir)
    problem = _apply_edits(spec, workdir) if spec["mode"] == "pytest" else ""
    isolated = spec["mode"] == "pytest" and spec["grading"] == "isolated"
    if isolated:
        os.makedirs(_tests_dir(workdir), mode=0o700)
    solution = None if problem else Solution(spec, workdir)
    secret = wire.recv(secret_fd)
    spec = {**spec, "setup": secret["setup"], "cases": secret["cases"]}
    verdict = {
        "status": "hack",
        "tests_passed": 0,
        "tests_total": 0,
        "message": problem,
    }
    if solution is not None:
        try:
            if isolated:
                verdict = _run_isolated(spec, solution, workdir)
            elif spec["mode"] == "pytest":
                verdict = _run_pytest(spec, solution, workdir)
            else:
                verdict = _run_cases(spec, solution)
        except Abort as e:
            verdict = {
                "status": e.status,
                "tests_passed": 0,
                "tests_total": len(spec["cases"]),
                "message": str(e),
            }
        solution.kill()
        solution.reap(block=True)
        solution.drain.join(0.2)
    drain = solution.drain if solution else None
    verdict.update(
        nonce=secret["nonce"],
        seconds=time.monotonic() - started,
        output=bytes(drain.head).decode("utf-8", "replace") if drain else "",
        output_bytes=drain.total if drain else 0,
        output_truncated=drain.truncated if drain else False,
    )
    wire.send(verdict_fd, verdict)
