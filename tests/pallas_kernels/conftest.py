"""Shared by the kernel tests: a program lowered for a GPU or a TPU on this CPU host.

``jax.export`` for platform "cuda" runs the Pallas Triton (or Mosaic GPU) lowering and for "tpu"
the Mosaic lowering, no accelerator needed. What it cannot check is the final compile (Triton to
PTX, Mosaic to TPU code); the ``gpu``-marked tests do that on a lent GPU.
"""

import jax
import pytest
from jax import export

def lowered_module(f, args, platform="cuda") -> str:
    """The MLIR text of jit(f)(*args) exported for `platform`."""
    # jax >= 0.11 lowers Triton for the device it targets: name one (an H100), as no GPU is here
    h100 = jax.sharding.AbstractDevice("NVIDIA H100 80GB HBM3", 132, "gpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h100)):
        exported = export.export(
            jax.jit(f),
            platforms=[platform],
            # no compatibility promise for kernels serialised into the module; nothing is stored
            disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
        )(*args)
    return exported.mlir_module()


@pytest.fixture
def lower():
    return lowered_module
