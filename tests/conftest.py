"""Test-wide set-up: 8 fake CPU devices and a cheap compiler (set once, before JAX initialises
its backends), and one compilation cache for the run.

Many tests compile the same programs (the same tiny model's steps, the same kernels at the same
shapes) from fresh closures; a persistent cache in a temporary folder compiles each once per run,
in this process and in the subprocesses tests start (they inherit the environment).
"""

import os
import shutil
import tempfile

# LLVM at -O0: the test programs are tiny, so compiling is most of their time, and -O0 takes
# about a third less of it (without fast-math, neither level may reorder float operations).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 "
                                   "--xla_backend_optimization_level=0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    import jax

    if "JAX_COMPILATION_CACHE_DIR" in os.environ:  # the caller's own cache wins
        return
    folder = tempfile.mkdtemp(prefix="jaxagent-tests-jit-")
    config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))
    cache = {
        "jax_compilation_cache_dir": folder,
        "jax_persistent_cache_min_compile_time_secs": 0,
        "jax_persistent_cache_min_entry_size_bytes": -1,
        # no size bound: with one, every write stats every entry (thousands here) to evict
    }
    for name, value in cache.items():
        os.environ[name.upper()] = str(value)
        jax.config.update(name, value)
