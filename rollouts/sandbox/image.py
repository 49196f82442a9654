"""The docker backend's sandbox image, built offline: from this host's files, or from a local
base image plus a requirements file.

`host_image` makes a minimal root file system from what runs here (the interpreter behind
`base_python()` at its own path with its standard library, `sh` and a few core utilities, each
with the shared libraries `ldd` names) and `docker import`s it: no registry, no package
manager. The tar is cached by a key of the files' paths, sizes and mtimes, and the image is
tagged with that key, so a second build costs a stat of each file. `image_with_requirements`
installs a requirements file with the host's pip into a folder and copies it to `/pylib` of a
local base image (where repository tasks and session commands import from).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from rollouts.sandbox.launchers import SANDBOX_PYLIB, SandboxUnavailable, base_python

# What session commands and the tests' shell lines use; `su` and friends stay out on purpose.
TOOLS = ("sh", "cat", "echo", "sleep", "head", "tail", "tr", "touch", "ln", "mkfifo", "mkdir", "rm", "ls", "grep", "id", "test", "env", "wc", "cp", "mv")  # fmt: skip
# Parts of the standard library no sandboxed run needs (tests, GUIs, build config, bundled pip).
_STDLIB_SKIP = re.compile(r"/(site-packages|test|idlelib|tkinter|turtledemo|ensurepip|lib2to3|config-[^/]*)(/|$)|/_test[^/]*\.so$|/_tkinter[^/]*\.so$|\.opt-[12]\.pyc$")  # fmt: skip
_LDD_PATH = re.compile(r"(/\S+) \(0x")
# glibc's other libraries, which code loads by name (ctypes.CDLL("librt.so.1")), beside libc.
_GLIBC_EXTRAS = ("librt.so.1", "libpthread.so.0", "libdl.so.2", "libutil.so.1", "libresolv.so.2")
_BUILDER_VERSION = "5"  # bump when the choice of files changes
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "jaxagent" / "sandbox-image"  # fmt: skip


def _docker(*args: str) -> str:
    """Run the docker CLI (DOCKER_HOST picks the engine); its stdout, or SandboxUnavailable."""
    proc = subprocess.run(["docker", *args], capture_output=True, check=False)
    if proc.returncode:
        why = proc.stderr.decode(errors="replace").strip()[-500:]
        raise SandboxUnavailable(f"`docker {args[0]}` failed: {why}")
    return proc.stdout.decode().strip()


def _libraries(binary: str) -> list[str]:
    """The shared libraries (and loader) `binary` needs, as `ldd` resolves them here."""
    out = subprocess.run(["ldd", binary], capture_output=True, text=True, check=False).stdout
    return [m.group(1) for m in _LDD_PATH.finditer(out)]


def _python_files(python: str) -> list[str]:
    """The interpreter, its shared library and its standard library (skipping `_STDLIB_SKIP`)."""
    prefix = os.path.realpath(sys.base_prefix)
    found = [python, *(str(p) for p in Path(prefix, "lib").glob("libpython3*.so*"))]
    stdlib = Path(prefix, "lib", f"python{sys.version_info.major}.{sys.version_info.minor}")
    for dirpath, dirnames, filenames in os.walk(stdlib):
        dirnames[:] = sorted(d for d in dirnames if not _STDLIB_SKIP.search(f"{dirpath}/{d}"))
        found += [f"{dirpath}/{f}" for f in sorted(filenames) if not _STDLIB_SKIP.search(f"{dirpath}/{f}")]
    return found


def host_files() -> list[str]:
    """Every host path the image holds: the interpreter's files, the tools, their libraries."""
    python = base_python()
    tools = [shutil.which(t) for t in TOOLS]
    missing = [t for t, path in zip(TOOLS, tools, strict=True) if path is None]
    if missing:
        raise SandboxUnavailable(f"sandbox image: tools missing on this host: {missing}")
    files = [*_python_files(python), *tools]
    binaries = [f for f in files if f.endswith(".so") or f in tools or f == python]
    libraries = {lib for b in binaries for lib in _libraries(b)}
    libc_dir = next(os.path.dirname(lib) for lib in libraries if os.path.basename(lib) == "libc.so.6")
    extras = {f"{libc_dir}/{name}" for name in _GLIBC_EXTRAS if os.path.exists(f"{libc_dir}/{name}")}
    return sorted(set(files) | libraries | extras)


def content_key(files: list[str]) -> str:
    """A key of the files' paths, sizes and mtimes (and of this builder)."""
    digest = hashlib.sha256(_BUILDER_VERSION.encode())
    for path in files:
        st = os.stat(path)
        digest.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def _add(tar: tarfile.TarFile, path: str, added: set[str]) -> None:
    """Add `path` as the host has it: its parent directories (or the symlinks standing for
    them, with their targets), then the symlink chain down to the file."""
    if path in added or path == "/":
        return
    added.add(path)
    parent = os.path.dirname(path)
    _add(tar, parent, added)
    info = tar.gettarinfo(path, arcname=path.lstrip("/"))
    if info.isdir():
        info.mode = 0o755  # /root is 0700 here: the solution's uid must walk through
        tar.addfile(info)
    elif info.issym():
        tar.addfile(info)
        _add(tar, os.path.normpath(os.path.join(parent, os.readlink(path))), added)
    else:
        with open(path, "rb") as f:
            tar.addfile(info, f)


def write_rootfs(files: list[str], out: Path) -> None:
    """The root file system tar: `files` at their host paths, `python3`/`python` in
    /usr/local/bin, an empty /tmp and /pylib; no /etc (no account needs a name, and a
    solution finds nothing there, as under bwrap)."""
    python = base_python()
    with tarfile.open(out, "w") as tar:
        added: set[str] = set()
        merged_usr = [d for d in ("/bin", "/sbin", "/lib", "/lib64") if os.path.islink(d)]
        for path in [*merged_usr, *files]:  # /bin/sh must resolve as it does here
            _add(tar, path, added)
        # explicit directories: `vfs` makes the ones a tar only implies 0600, which no uid
        # but root walks through
        for name in ("tmp", SANDBOX_PYLIB.lstrip("/"), "usr/local", "usr/local/bin"):
            if f"/{name}" in added:
                continue
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if name == "tmp" else 0o755
            tar.addfile(info)
        for link in ("python3", "python"):
            info = tarfile.TarInfo(f"usr/local/bin/{link}")
            info.type, info.linkname = tarfile.SYMTYPE, python
            tar.addfile(info)


def _image_exists(tag: str) -> bool:
    try:
        _docker("image", "inspect", "--format", "{{.Id}}", tag)
    except SandboxUnavailable:
        return False
    return True


def host_image(cache: Path = DEFAULT_CACHE, repository: str = "jaxagent-sandbox") -> str:
    """Build (or find) the host-made sandbox image on the engine DOCKER_HOST names; its tag."""
    files = host_files()
    key = content_key(files)
    tag = f"{repository}:{key}"
    if _image_exists(tag):
        return tag
    tar = cache / f"rootfs-{key}.tar"
    if not tar.exists():
        cache.mkdir(parents=True, exist_ok=True)
        partial = tar.with_suffix(f".{os.getpid()}.part")
        write_rootfs(files, partial)
        for stale in cache.glob("rootfs-*.tar"):  # one cached tar: the host's files changed
            if stale != tar:  # another process (a test worker) may be importing this one
                stale.unlink(missing_ok=True)
        partial.rename(tar)  # atomic: a concurrent builder's identical tar is replaced whole
    env = "ENV PATH=/usr/local/bin:/usr/bin:/bin LANG=C.UTF-8"
    _docker("import", "--change", env, "--change", "WORKDIR /tmp", str(tar), tag)
    return tag


def image_with_requirements(base: str, requirements: str, tag: str, find_links: str | None = None) -> str:  # fmt: skip
    """`base` (a local image) with `requirements` installed into /pylib: by the host's pip
    (offline with `find_links`, a folder of wheels), then copied in by a COPY-only build."""
    with tempfile.TemporaryDirectory(prefix="jaxagent-image-") as context:
        pip = [sys.executable, "-m", "pip", "install", "-q", "--target", f"{context}/pylib",
               "-r", requirements]  # fmt: skip
        if find_links:
            pip += ["--no-index", "--find-links", find_links]
        subprocess.run(pip, check=True)
        Path(context, "Dockerfile").write_text(f"FROM {base}\nCOPY pylib {SANDBOX_PYLIB}\n")
        env = {**os.environ, "DOCKER_BUILDKIT": "0"}  # the classic builder: no buildx needed
        subprocess.run(["docker", "build", "-q", "-t", tag, context], check=True, env=env,
                       stdout=subprocess.DEVNULL)
    return tag
