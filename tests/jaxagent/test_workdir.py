import os
import signal
import subprocess
import sys

import pytest

from jaxagent.workdir import WorkdirBusy, workdir_lock

HOLD = """
import sys, time
from jaxagent.workdir import workdir_lock
with workdir_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(60)
"""


def _holder(workdir):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(workdir)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline() == "held\n"
    return proc


def test_second_run_refuses_naming_the_holder_then_takes_over_after_a_kill(tmp_path):
    holder = _holder(tmp_path)
    try:
        with pytest.raises(WorkdirBusy, match=rf"pid {holder.pid}") as e, workdir_lock(tmp_path):
            pass
        assert "\n" not in str(e.value)
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    said = []
    with workdir_lock(tmp_path, report=said.append):
        assert (tmp_path / ".lock").read_text().endswith(f"pid {os.getpid()}\n")
    assert len(said) == 1 and f"pid {holder.pid}" in said[0] and "taking over" in said[0]
    said.clear()
    with workdir_lock(tmp_path, report=said.append):  # after a clean exit: nothing to report
        pass
    assert said == []


def test_processes_of_one_run_lock_apart(tmp_path):
    with workdir_lock(tmp_path, 0, 2), workdir_lock(tmp_path, 1, 2):
        with pytest.raises(WorkdirBusy):
            with workdir_lock(tmp_path, 1, 2):
                pass
    with workdir_lock(tmp_path, 1, 2):
        pass
