"""The agent's tools over a sandbox session: shell, files, tests, lint, search, history,
memory, think, finish. Each is declared once in `TOOLS` (schema + function)."""

from __future__ import annotations

import dataclasses
import re

from rollouts.sandbox.run_cache import RunCache
from rollouts.sandbox.session import ExecResult, Session, SessionError
from rollouts.tasks.task import Task, pytest_args
from rollouts.tools.core import Param, Tool, ToolError
from rollouts.tools.embedding import Embedding, NgramEmbedding, chunks, rank
from rollouts.tools.memory import MemoryStore

LINT_RULES = "E9,F"  # syntax errors and pyflakes, as the single-turn lint penalty
_COMMIT = re.compile(r"^(?:[0-9a-fA-F]{4,40}|HEAD(?:~[0-9]{1,4})?)$")
_GIT = ["git", "-c", "safe.directory=*", "--no-pager"]


@dataclasses.dataclass
class ToolContext:
    session: Session
    task: Task
    memory: MemoryStore | None = None
    embedding: Embedding = dataclasses.field(default_factory=NgramEmbedding)
    timeout_s: float = 10.0  # per tool call
    max_results: int = 20  # search hits, history entries
    run_cache: RunCache | None = None  # test runs shared with other sessions (`RunCache`)
    cached_test_runs: int = 0  # this episode's `run_tests` calls read from `run_cache`

    @property
    def repo_key(self) -> str:
        return str(self.task.metadata.get("repo_key") or self.task.repo or self.task.id)


def _file_op(fn, *args):
    try:
        return fn(*args)
    except SessionError as e:
        raise ToolError(str(e)) from None


def _run(ctx: ToolContext, command: str | list[str]) -> ExecResult:
    result = ctx.session.exec(command, timeout_s=ctx.timeout_s)
    if result.over_quota:
        raise ToolError(
            f"the repository outgrew {ctx.session.limits.tmpfs_mb} MB; delete large files"
        )
    return result


def _status(result: ExecResult) -> str:
    if result.timed_out:
        return f"[timed out after {result.seconds:.1f}s]"
    note = f"[exit code {result.exit_code}]"
    if result.output_bytes > len(result.output.encode()):
        note += f" [output capped at {len(result.output.encode())} of {result.output_bytes} bytes]"
    return note


def shell(ctx: ToolContext, command: str) -> str:
    result = _run(ctx, command)
    return f"{result.output}{_status(result)}"


def read_file(ctx: ToolContext, path: str, start_line: int = 1, end_line: int = 0) -> str:
    lines = _file_op(ctx.session.read_text, path).splitlines()
    if lines and start_line > len(lines):
        raise ToolError(f"read_file: {path} has only {len(lines)} lines")
    end = end_line or len(lines)
    if start_line < 1 or end < start_line:
        raise ToolError(f"read_file: bad line range {start_line}..{end_line}")
    body = "\n".join(f"{i:>5}  {lines[i - 1]}" for i in range(start_line, min(end, len(lines)) + 1))
    return f"{path} (lines {start_line}-{min(end, len(lines))} of {len(lines)})\n{body}"


def write_file(ctx: ToolContext, path: str, content: str) -> str:
    _file_op(ctx.session.write_text, path, content)
    return f"wrote {path} ({len(content.splitlines())} lines)"


def edit(ctx: ToolContext, path: str, search: str, replace: str) -> str:
    if not search:
        raise ToolError("edit: 'search' must not be empty")
    text = _file_op(ctx.session.read_text, path)
    count = text.count(search)
    if count == 0:
        raise ToolError(
            f"edit: the search text was not found in {path}; read the file and copy it exactly"
        )
    if count > 1:
        raise ToolError(
            f"edit: the search text occurs {count} times in {path}; include more context"
        )
    _file_op(ctx.session.write_text, path, text.replace(search, replace, 1))
    line = text[: text.index(search)].count("\n") + 1
    return f"edited {path} at line {line}"


def replace_line(ctx: ToolContext, path: str, line: int, text: str) -> str:
    """Line `line` of `path` becomes `text` (several lines where `text` holds newlines): an edit
    named by the line number `read_file` shows, so the call carries no search text to copy."""
    old = _file_op(ctx.session.read_text, path)
    lines = old.splitlines(keepends=True)
    if not 1 <= line <= len(lines):
        raise ToolError(f"replace_line: {path} has {len(lines)} lines; 'line' must be "
                        f"1..{len(lines)}")
    ending = "\n" if lines[line - 1].endswith("\n") else ""
    lines[line - 1] = text + ending
    _file_op(ctx.session.write_text, path, "".join(lines))
    return f"replaced line {line} of {path}"


def run_tests(ctx: ToolContext, test: str = "") -> str:
    if test.startswith("-"):
        raise ToolError("run_tests: 'test' is a test path or id, not an option")
    args = [test] if test else list(pytest_args(ctx.task.test_command))
    result, outcomes = ctx.session.run_pytest(args, timeout_s=ctx.timeout_s, cache=ctx.run_cache)
    ctx.cached_test_runs += result.cached
    if result.timed_out:
        return f"tests timed out after {result.seconds:.1f}s"
    failed = [(t, why or kind) for t, (kind, why) in outcomes.items() if kind in ("failed", "error")]
    n_pass = sum(kind in ("passed", "xpass") for kind, _ in outcomes.values())
    n_fail = len(failed)
    head = f"tests: {n_pass} passed, {n_fail} failed (exit code {result.exit_code})"
    if not n_pass and not n_fail:  # a usage error, nothing collected: show pytest's words
        return f"{head}\n{undecorated(result.output)[-2000:]}"
    lines = [head] + [f"FAILED {t} - {why}" for t, why in failed]
    if n_fail:  # the failure details (tracebacks) precede the short summary
        lines.append(failure_details(result.output)[-2000:])
    return "\n".join(lines)


_BANNER = re.compile(r"^[=_!]{3,} (.*?) [=_!]{3,}$")
_SECTION = re.compile(r"^=+ (?:ERRORS|FAILURES) =+$", re.MULTILINE)


def failure_details(output: str) -> str:
    """pytest's tracebacks without its decoration: the sections from the first `ERRORS` or
    `FAILURES` on, `undecorated` (a context-bound policy reads the same facts in a third of
    the tokens)."""
    body = output.split("short test summary info")[0]
    return undecorated(_SECTION.split(body, maxsplit=1)[-1])


def undecorated(output: str) -> str:
    """pytest's text with each `____ name ____` banner shortened to `--- name` and the blank,
    separator and `^^^` marker lines dropped: their widths follow the terminal's."""
    lines = []
    for line in output.splitlines():
        banner = _BANNER.match(line.strip())
        if banner:
            lines.append(f"--- {banner.group(1)}")
        elif set(line) - set("=_^ "):  # not blank, a separator or a column marker (^^^)
            lines.append(line)
    return "\n".join(lines)


def lint(ctx: ToolContext, path: str = ".") -> str:
    if path.startswith("-"):
        raise ToolError("lint: 'path' must be a path, not an option")
    if path != ".":
        _file_op(ctx.session.path, path)
    argv = ["ruff", "check", "--isolated", "--no-cache", "--output-format", "concise", "--quiet"]
    result = _run(ctx, [*argv, "--select", LINT_RULES, "--", path])
    if result.exit_code not in (0, 1):
        raise ToolError(f"lint: ruff failed: {result.output[-500:]}")
    return result.output.strip() or "no issues"


def search(ctx: ToolContext, query: str, mode: str = "regex", path: str = ".") -> str:
    if mode == "semantic":
        files = ctx.session.files()
        prefix = "" if path == "." else path.rstrip("/")
        pool = [c for p, text in files.items() if p.startswith(prefix) for c in chunks(p, text)]
        hits = rank(ctx.embedding, query, pool, ctx.max_results // 4 or 1)
        if not hits:
            return "no code to search"
        return "\n\n".join(
            f"{c.path}:{c.start}-{c.end} (score {s:.2f})\n{c.text[:800]}" for s, c in hits
        )
    if path.startswith("-"):
        raise ToolError("search: 'path' must be a path, not an option")
    # grep runs in the sandbox: an adversarial pattern cannot hang the host
    argv = ["grep", "-rnE", "--exclude-dir=.git", "-m", str(ctx.max_results), "-e", query, "--", path]
    result = _run(ctx, argv)
    if result.exit_code == 1:
        return f"no matches for {query!r}"
    if result.exit_code != 0:
        raise ToolError(f"search: {result.output.strip()[-500:] or _status(result)}")
    lines = result.output.splitlines()
    more = f"\n[{len(lines) - ctx.max_results} more matches not shown]" if len(lines) > ctx.max_results else ""
    return "\n".join(lines[: ctx.max_results]) + more


def history(ctx: ToolContext, path: str = "", commit: str = "") -> str:
    if not (ctx.session.root / ".git").is_dir():
        raise ToolError("history: this repository has no git history")
    if commit:
        if not _COMMIT.match(commit):
            raise ToolError("history: 'commit' must be a commit hash or HEAD~N")
        result = _run(ctx, [*_GIT, "show", "--stat", "--patch", "--format=medium", commit, "--"])
    else:
        if path.startswith("-"):
            raise ToolError("history: 'path' must be a path, not an option")
        argv = [*_GIT, "log", f"-n{ctx.max_results}", "--format=%h %ad %s", "--date=short"]
        result = _run(ctx, [*argv, "--", *([path] if path else [])])
    if result.exit_code != 0:
        raise ToolError(f"history: {result.output.strip()[-500:]}")
    return result.output.strip() or f"no commits touch {path!r}"


def memory(ctx: ToolContext, action: str, note: str = "") -> str:
    if ctx.memory is None:
        raise ToolError("memory: no memory store is configured for this run")
    if action == "write":
        if not note.strip():
            raise ToolError("memory: 'note' must not be empty when writing")
        return f"saved; {ctx.memory.write(ctx.repo_key, note)} notes for this repository"
    notes = ctx.memory.read(ctx.repo_key)
    return "\n".join(f"- {n}" for n in notes) if notes else "no notes yet for this repository"


def think(ctx: ToolContext, thought: str) -> str:
    del ctx, thought  # a scratchpad: nothing happens
    return "ok"


def finish(ctx: ToolContext, summary: str = "") -> str:
    del ctx
    return f"finished: {summary}" if summary else "finished"


_PATH = Param("path", "string", "file path relative to the repository root")
TOOLS: tuple[Tool, ...] = (
    Tool("shell", "Run a shell command in the repository (sandboxed, no network).",
         (Param("command", "string", "the command line"),), shell),
    Tool("read_file", "Show a file with line numbers, optionally a line range.",
         (_PATH, Param("start_line", "integer", "first line (1-based)", False),
          Param("end_line", "integer", "last line (inclusive)", False)), read_file),
    Tool("write_file", "Create or overwrite a file.",
         (_PATH, Param("content", "string", "the whole new content")), write_file),
    Tool("edit", "Replace one exact occurrence of `search` in a file by `replace`.",
         (_PATH, Param("search", "string", "exact text to find (must occur once)"),
          Param("replace", "string", "replacement text")), edit),
    Tool("replace_line", "Replace one line of a file (by its number) with new text.",
         (_PATH, Param("line", "integer", "the line number (1-based, as read_file shows)"),
          Param("text", "string", "the new line (several lines if it holds newlines)")),
         replace_line),
    Tool("run_tests", "Run the task's tests (or one test path/id); pass/fail summary.",
         (Param("test", "string", "a test file or node id", False),), run_tests),
    Tool("lint", "ruff diagnostics (syntax errors, undefined names, unused imports).",
         (Param("path", "string", "file or directory (default: all)", False),), lint),
    Tool("search", "Search the code: grep-style regex, or semantic similarity.",
         (Param("query", "string", "a regex (regex mode) or a description (semantic)"),
          Param("mode", "string", "regex or semantic", False, ("regex", "semantic")),
          Param("path", "string", "directory or file to search", False)), search),
    Tool("history", "Git history: commits touching a path, or one commit's diff.",
         (Param("path", "string", "path whose commits to list", False),
          Param("commit", "string", "a commit hash to show", False)), history),
    Tool("memory", "Read or write notes kept across episodes on this repository.",
         (Param("action", "string", "read or write", True, ("read", "write")),
          Param("note", "string", "the note to save", False)), memory),
    Tool("think", "Think step by step; no effect.",
         (Param("thought", "string", "your reasoning"),), think),
    Tool("finish", "End the episode; your changes are then graded.",
         (Param("summary", "string", "what you changed", False),), finish),
)
