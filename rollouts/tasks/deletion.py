"""Repository tasks made by feature deletion.

Take a Python repository whose tests pass, replace the bodies of one or more functions (a
feature) by `raise NotImplementedError`, keeping signatures and docstrings, and keep the tests
that now fail as the task's target. Both directions are checked by running the tests in a
sandbox session: the original passes every test, the deleted version fails the targets. The
task's git history is replayed with the same deletion applied to every commit, so `history`
shows real commits but never the deleted code.

No copy of a deleted body may survive: generated artefacts (build copies, bytecode, rendered
docs, coverage reports, patch leftovers: `leaks.generated`) are dropped from the repository and
from every commit, a function elsewhere whose body is a copy (a vendored duplicate; in old
commits, an older name or place of the function) has its body deleted too
(`with_vendored_copies`, `_stub_copies`), and a feature whose body is still found anywhere
else (the other files, the prompt, any commit or commit message: `leaks.find_leaks`) is
refused, naming the file and line. Binary files are carried byte for byte.

On disk a task is `DIR/ID/task.json`, `DIR/ID/repo/` (the deleted repository) and, when the
source has git history, `DIR/ID/history.bundle`.
"""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath

from rollouts.sandbox import Limits, Sandbox
from rollouts.sandbox.session import Session
from rollouts.sandbox.types import check_skips
from rollouts.tasks.embedded import git
from rollouts.tasks.leaks import Body, Leak, Readings, find_leaks, generated
from rollouts.tasks.repo import choose_grading, load_repo_task
from rollouts.tasks.task import Task, TaskFormatError, pytest_args

STUB = "raise NotImplementedError"
# How a test of the original run that did not pass may end (session outcome -> the grader's
# name): recorded in task.json, the grader lets exactly these end so again.
_SKIPS = {"skipped": "skipped", "xfail": "xfailed"}
# Files a solution may not edit (the grader calls it a hack), so their copies are not deleted.
_NOT_VENDORED = {"conftest.py", "sitecustomize.py", "usercustomize.py"}


@dataclass(frozen=True)
class Target:
    """`path::Qual.name` of a function or method."""

    path: str
    qualname: str

    @classmethod
    def parse(cls, spec: str) -> Target:
        path, sep, qualname = spec.partition("::")
        if not sep or not path.endswith(".py") or not qualname:
            raise ValueError(f"feature target {spec!r} must look like path/to/mod.py::Class.func")
        return cls(path, qualname)

    def __str__(self) -> str:
        return f"{self.path}::{self.qualname}"


def _functions(tree: ast.Module) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    """Qualified name -> node for module-level functions and methods of top-level classes."""
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = node
        elif isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out[f"{node.name}.{sub.name}"] = sub
    return out


def _body_spans(source: str, qualnames: Sequence[str], strict: bool) -> list[tuple[str, int, int, int]]:
    """(name, first line index, end line, indent) of each named function's body after its
    docstring. `strict`: a name that is absent or has nothing but a docstring is a ValueError."""
    funcs = _functions(ast.parse(source))
    spans = []
    for name in qualnames:
        node = funcs.get(name)
        body = node.body[1:] if node is not None and ast.get_docstring(node) else (node.body if node else [])
        if not body:
            if strict:
                raise ValueError(f"{name}: no such function, or it has no body beyond a docstring")
            continue
        spans.append((name, body[0].lineno - 1, node.end_lineno, body[0].col_offset))
    return spans


def delete_bodies(source: str, qualnames: Sequence[str], strict: bool = True) -> str:
    """`source` with each named function's body (after its docstring) replaced by the stub."""
    lines = source.splitlines(keepends=True)
    for _, start, end, indent in sorted(_body_spans(source, qualnames, strict), key=lambda s: -s[1]):
        lines[start:end] = [f"{' ' * indent}{STUB}\n"]
    return "".join(lines)


def deleted_bodies(files: dict[str, str | bytes], feature: Sequence[Target]) -> list[Body]:
    """The source each target's deletion removes, as leak patterns."""
    out = []
    for t in feature:
        lines = files[t.path].splitlines(keepends=True)
        for _, start, end, _ in _body_spans(files[t.path], [t.qualname], True):
            out.append(Body(str(t), "".join(lines[start:end])))
    return out


def _enclosing(source: str, line: int) -> str | None:
    """The function or method (as `_functions` names them) whose body holds `line`."""
    try:
        funcs = _functions(ast.parse(source))
    except SyntaxError:
        return None
    for name, node in funcs.items():
        body = node.body[1:] if ast.get_docstring(node) else node.body
        if body and body[0].lineno <= line <= node.end_lineno:
            return name
    return None


# A function whose body holds this share of a deleted body's words is a duplicate (deleted
# too); one that shares less but still several lines (`leaks.REVEAL_WORDS`) leaves a leak that
# refuses the feature; one sharing an idiom is no copy (`leaks.Body.find`).
VENDORED_SHARE = 0.5


def _copies_most_of(source: str, name: str, bodies: Sequence[Body]) -> bool:
    lines = source.splitlines(keepends=True)
    (_, start, end, _), = _body_spans(source, [name], True)
    return any(b.share("".join(lines[start:end])) >= VENDORED_SHARE for b in bodies)


def with_vendored_copies(files: dict[str, str | bytes], feature: Sequence[Target],
                         test_paths: Sequence[str], readings: Readings | None = None,
                         ) -> tuple[tuple[Target, ...], list[Leak]]:
    """(`feature` and every function outside the tests whose body is a copy of most of a
    deleted body, the copies left in the files once they are all deleted). A vendored
    duplicate, which tests may import, has its body deleted too, so the answer is not in the
    task, and its tests fail until it is written again; a copy anywhere else (module level,
    the tests, a non-Python file, a function sharing only a fragment) is left for the caller
    to refuse."""
    feature = list(feature)
    while True:
        deleted = dict(files)
        for path in {t.path for t in feature}:
            deleted[path] = delete_bodies(files[path], [t.qualname for t in feature if t.path == path])
        extra = []
        bodies = deleted_bodies(files, feature)
        leaks = find_leaks(bodies, deleted, readings=readings)
        for leak in leaks:
            text = deleted.get(leak.path)
            if (not isinstance(text, str) or not leak.path.endswith(".py")
                    or PurePosixPath(leak.path).name in _NOT_VENDORED
                    or _in_tests(leak.path, test_paths)):
                continue
            name = _enclosing(text, leak.line)
            target = Target(leak.path, name) if name else None
            if (target and target not in feature and target not in extra
                    and _copies_most_of(text, name, bodies)):
                extra.append(target)
        if not extra:
            return tuple(feature), leaks
        feature += extra


def _in_tests(path: str, test_paths: Sequence[str]) -> bool:
    return any(path.startswith(p.rstrip("/") + "/") for p in test_paths)


def _sources(files: dict[str, str | bytes], test_paths: Sequence[str]) -> Iterator[tuple[str, str, ast.Module]]:
    """(path, text, tree) of each Python source outside the tests."""
    for path, text in sorted(files.items()):
        if not path.endswith(".py") or isinstance(text, bytes) or _in_tests(path, test_paths):
            continue
        try:
            yield path, text, ast.parse(text)
        except SyntaxError:  # a template or another Python's file: nothing to delete from
            continue


def candidates(files: dict[str, str], test_paths: Sequence[str]) -> list[Target]:
    """Every documented function or method outside the tests whose body can be deleted."""
    return [Target(path, name) for path, _, tree in _sources(files, test_paths)
            for name, node in _functions(tree).items()
            if ast.get_docstring(node) and len(node.body) > 1]


def every_body(files: dict[str, str | bytes], test_paths: Sequence[str]) -> list[Body]:
    """The body of every function outside the tests, as leak patterns: all a feature and the
    vendored copies it takes along may delete."""
    out = []
    for path, text, tree in _sources(files, test_paths):
        lines = text.splitlines(keepends=True)
        out += [Body(f"{path}::{name}", "".join(lines[start:end]))
                for name, start, end, _ in _body_spans(text, list(_functions(tree)), False)]
    return out


def _signature(text: str, qualname: str) -> tuple[str, str]:
    node = _functions(ast.parse(text))[qualname]
    args = ast.unparse(node.args)
    return f"{qualname}({args})", ast.get_docstring(node) or ""


def _test_source(files: dict[str, str], test_id: str) -> str:
    path, _, name = test_id.partition("::")
    parts = name.split("::")
    nodes = ast.parse(files[path]).body
    for part in parts:
        node = next(n for n in nodes if getattr(n, "name", None) == part.split("[")[0])
        nodes = getattr(node, "body", [])
    return ast.get_source_segment(files[path], node) or ""


def deletion_prompt(original: dict[str, str], feature: Sequence[Target], targets: Sequence[str]) -> str:
    lines = ["Part of this repository is missing: the bodies of these functions were replaced by",
             f"`{STUB}`. Implement them so that the failing tests pass.", ""]
    for t in feature:
        sig, doc = _signature(original[t.path], t.qualname)
        lines.append(f"- {t.path}: {sig}")
        lines += [f"    {d}" for d in doc.splitlines()]
    lines += ["", "Tests that must pass (do not edit the tests; edits to them are discarded):"]
    for test in targets:
        lines += ["", f"# {test}", _test_source(original, test)]
    return "\n".join(lines) + "\n"


def _outcomes(files: dict[str, str], test_command: Sequence[str], backend: str,
              limits: Limits) -> dict[str, str]:
    with Session(files, backend=backend, limits=limits) as s:
        result, outcomes = s.run_pytest(list(pytest_args(tuple(test_command))))
    if result.timed_out:
        raise RuntimeError(f"the tests timed out after {result.seconds:.1f}s")
    return {test: kind for test, (kind, _) in outcomes.items()}


def _show(repo: Path, sha: str, path: str) -> str | bytes:
    """A file at a commit: str if UTF-8 text, else its bytes."""
    data = subprocess.run(["git", "-C", str(repo), "-c", "safe.directory=*", "show",
                           f"{sha}:{path}"], check=True, capture_output=True).stdout
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data


def _blobs(repo: Path, sha: str) -> list[str]:
    """The files of a commit (not its submodules: their commits are not in this repository)."""
    entries = git(repo, "ls-tree", "-r", "-z", sha).split("\0")
    return [entry.split("\t", 1)[1] for entry in entries if entry.split(" ", 2)[1:2] == ["blob"]]


def _write(root: Path, files: dict[str, str | bytes]) -> None:
    for path, content in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            (root / path).write_bytes(content)
        else:
            (root / path).write_text(content)


def _stub_copies(files: dict[str, str | bytes], bodies: Sequence[Body], seen: dict,
                 readings: Readings | None = None) -> list[Leak]:
    """Delete the body of every function in `files` (a commit of the history, which no test
    runs) that holds a copy of one of `bodies`: an older name or place of a deleted function,
    a vendored copy since removed. Returns the copies left (outside any function, not Python)."""
    while True:
        leaks = find_leaks(bodies, files, seen, readings)
        stubbed = False
        for path in sorted({leak.path for leak in leaks}):
            text = files.get(path)
            if not isinstance(text, str) or not path.endswith(".py"):
                continue
            names = {_enclosing(text, leak.line) for leak in leaks if leak.path == path} - {None}
            if names:
                files[path] = delete_bodies(text, sorted(names), strict=False)
                stubbed = True
        if not stubbed:
            return leaks


def _replay_history(source: Path, dest: Path, feature: Sequence[Target],
                    bodies: Sequence[Body], readings: Readings | None = None) -> str | None:
    """Re-create `source`'s first-parent history at `dest` with the feature deleted in every
    commit (names a commit does not have yet are left alone), any other function holding a
    copy of a deleted body deleted too (`_stub_copies`) and generated artefacts dropped. Only
    these commits reach the task: no other branch, tag, stash, note or reflog. Returns where
    a commit (its files or its message) still holds a copy of a deleted body (and stops),
    else None."""
    git(dest, "init", "-q", "-b", "main")
    seen: dict = {}  # what each file content held (most are unchanged between commits)
    for sha in git(source, "rev-list", "--reverse", "--first-parent", "HEAD").split():
        for old in dest.iterdir():
            if old.name != ".git":
                shutil.rmtree(old) if old.is_dir() else old.unlink()
        files = {}
        for path in _blobs(source, sha):
            if generated(path):
                continue
            content = _show(source, sha, path)
            if generated(path, content):  # bytecode under another name, archived artefacts
                continue
            names = [t.qualname for t in feature if t.path == path]
            if names and isinstance(content, str):
                try:
                    content = delete_bodies(content, names, strict=False)
                except SyntaxError:  # a broken commit: kept, and refused below if it copies
                    pass
            files[path] = content
        an, ae, ad, cd, msg = git(source, "log", "-1", "--format=%an%x00%ae%x00%aI%x00%cI%x00%B", sha).split("\0")
        if leaks := (_stub_copies(files, bodies, seen, readings)
                     + find_leaks(bodies, {"its message": msg})):
            return f"commit {sha[:12]}: {leaks[0]}"
        _write(dest, files)
        git(dest, "add", "-A")
        git(dest, "commit", "-q", "--allow-empty", "-m", msg.strip(),
            env={"GIT_AUTHOR_NAME": an, "GIT_AUTHOR_EMAIL": ae, "GIT_AUTHOR_DATE": ad,
                 "GIT_COMMITTER_NAME": an, "GIT_COMMITTER_EMAIL": ae, "GIT_COMMITTER_DATE": cd})


def history_leaks(bundle: str | Path, bodies: Sequence[Body]) -> list[str]:
    """Where the commits of a history bundle (of every ref it holds: files and messages) copy
    one of `bodies`, as "commit SHA: LEAK" (for `jaxagent tasks check` on made tasks)."""
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp)
        subprocess.run(["git", "clone", "-q", "--mirror", str(bundle), str(repo)], check=True,
                       capture_output=True)
        seen: dict = {}
        out = []
        for sha in git(repo, "rev-list", "--all").split():
            files = {path: _show(repo, sha, path)
                     for path in _blobs(repo, sha)}
            files["its message"] = git(repo, "log", "-1", "--format=%B", sha)
            out += [f"commit {sha[:12]}: {leak}" for leak in find_leaks(bodies, files, seen)]
        return out


@dataclass(frozen=True)
class Made:
    task_id: str
    feature: tuple[Target, ...]
    targets: tuple[str, ...]  # tests that pass on the original and fail once deleted


def make_deletion_tasks(
    repo: str | Path,
    out: str | Path,
    test_command: Sequence[str] = ("python", "-m", "pytest", "tests"),
    test_paths: Sequence[str] = ("tests",),
    features: Sequence[Sequence[Target]] | None = None,
    backend: str = "bwrap",
    limits: Limits | None = None,
) -> tuple[list[Made], list[str]]:
    """Write one task per feature (default: one per documented function) under `out`.
    Returns the tasks made and, for each feature skipped, why."""
    repo, out = Path(repo).resolve(), Path(out).resolve()
    limits = limits or Limits(wall_s=60, cpu_s=60)
    base = load_repo_task(repo, list(test_command), test_paths=tuple(test_paths))
    files = {path: c for path, c in base.files.items() if not generated(path, c)}
    original = _outcomes(files, test_command, backend, limits)
    bad = sorted(t for t, kind in original.items() if kind not in ("passed", "xpass", *_SKIPS))
    skips = {t: _SKIPS[kind] for t, kind in original.items() if kind in _SKIPS}
    if not original or bad:
        dropped = sorted(set(base.files) - set(files))
        without = (f" (they run without the {len(dropped)} generated artefacts a task drops, "
                   f"e.g. {', '.join(dropped[:3])})" if dropped else "")
        raise TaskFormatError(f"{repo}: the tests must pass before deleting anything{without}; "
                              f"failing: {bad or 'no tests ran'}")
    has_git = (repo / ".git").is_dir()
    made, skipped = [], []
    # the files' readings, made once for every feature's scan (a file over its budget is
    # searched once for every body a feature may delete)
    readings = Readings(anticipated=lambda: every_body(files, test_paths))
    # one sandbox grades every feature's reference (it starts on the first run)
    with Sandbox(backend, workers=1, limits=limits) as sandbox:
        for feature in features or [[t] for t in candidates(files, test_paths)]:
            asked = tuple(feature)
            task_id = f"{repo.name}-" + "+".join(t.qualname for t in asked).replace(".", "-").lower()
            for t in asked:
                if t.path not in files:
                    raise TaskFormatError(f"{repo}: feature target {t}: no such file")
            name = "+".join(map(str, asked))
            feature, leaks = with_vendored_copies(files, asked, test_paths, readings)
            if leaks:  # refused before its tests run
                skipped.append(f"{name}: refused: {leaks[0]}")
                continue
            by_path: dict[str, list[str]] = {}
            for t in feature:
                by_path.setdefault(t.path, []).append(t.qualname)
            deleted = dict(files)
            for path, names in by_path.items():
                deleted[path] = delete_bodies(files[path], names)
            after = _outcomes(deleted, test_command, backend, limits)
            targets = tuple(sorted(t for t, kind in original.items()
                                   if kind == "passed" and after.get(t) != "passed"))
            if not targets:
                skipped.append(f"{name}: no test fails once it is deleted")
                continue
            prompt = deletion_prompt(files, feature, targets)
            bodies = deleted_bodies(files, feature)
            if leaks := find_leaks(bodies, {"the task's prompt": prompt}):
                skipped.append(f"{name}: refused: {leaks[0]}")
                continue
            task_dir = out / task_id
            with tempfile.TemporaryDirectory() as tmp:
                if has_git and (leak := _replay_history(repo, Path(tmp), feature, bodies,
                                                        readings)):
                    skipped.append(f"{name}: refused: {leak}")
                    continue
                if task_dir.exists():
                    shutil.rmtree(task_dir)
                (task_dir / "repo").mkdir(parents=True)
                _write(task_dir / "repo", deleted)
                if has_git:
                    git(Path(tmp), "bundle", "create", "-q", str(task_dir / "history.bundle"), "--all")
            reference = {path: files[path] for path in by_path}
            task = replace(base, id=task_id, files=deleted, repo=str(task_dir / "repo"),
                           metadata={**base.metadata, "skips": skips})
            try:
                grading = choose_grading(task, json.dumps(reference), sandbox)
            except TaskFormatError as e:  # e.g. a reference the grader will not take
                shutil.rmtree(task_dir)
                skipped.append(f"{name}: refused: {e}")
                continue
            spec = {
                "id": task_id,
                "prompt": prompt,
                "test_command": list(test_command),
                "test_paths": list(test_paths),
                "target_tests": list(targets),
                "feature": [str(t) for t in feature],
                "vendored": [str(t) for t in feature[len(asked):]],  # copies deleted too
                "repo_key": repo.name,
                "reference": reference,
                "grading": grading,
                "dropped": sorted(set(base.files) - set(files)),  # generated artefacts
                "skips": skips,  # tests (or modules) the original run skipped or xfailed
            }
            (task_dir / "task.json").write_text(json.dumps(spec, indent=1))
            made.append(Made(task_id, feature, targets))
    return made, skipped


def load_deletion_tasks(root: str | Path) -> list[Task]:
    """Every task written by `make_deletion_tasks` under `root` (ROOT/ID/task.json)."""
    root = Path(root)
    dirs = sorted(p for p in root.iterdir() if (p / "task.json").is_file()) if root.is_dir() else []
    if not dirs:
        raise TaskFormatError(f"no DIR/ID/task.json under {root}")
    return [load_deletion_task(d) for d in dirs]


def load_deletion_task(task_dir: str | Path) -> Task:
    """A task written by `make_deletion_tasks`; `metadata["reference"]` is a passing completion."""
    task_dir = Path(task_dir)
    spec_file = task_dir / "task.json"
    try:
        spec = json.loads(spec_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise TaskFormatError(f"{spec_file}: cannot read the task ({e})") from None
    for key in ("id", "prompt", "test_command", "test_paths", "target_tests", "reference"):
        if key not in spec:
            raise TaskFormatError(f"{spec_file}: missing field {key!r}")
    try:
        check_skips(spec.get("skips"), "field 'skips'")
    except ValueError as e:
        raise TaskFormatError(f"{spec_file}: {e}") from None
    task = load_repo_task(task_dir / "repo", spec["test_command"], spec["id"], spec["prompt"],
                          tuple(spec["test_paths"]), spec.get("grading", "isolated"))
    bundle = task_dir / "history.bundle"
    metadata = {
        **task.metadata,
        "target_tests": list(spec["target_tests"]),
        "feature": list(spec.get("feature", [])),
        "repo_key": spec.get("repo_key", spec["id"]),
        "reference": json.dumps(spec["reference"]),
        "git_source": str(bundle) if bundle.exists() else None,
        "skips": spec.get("skips"),  # None for a task made before skips were recorded
    }
    return replace(task, metadata=metadata)
