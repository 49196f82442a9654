"""The model/kernel seam in imports: models reach pallas_kernels through its public attention
functions only and never import sharding (it is applied from outside, by a rules context);
pallas_kernels never imports jaxagent."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PUBLIC_KERNELS = {"pallas_kernels.attention", "pallas_kernels.nsa"}  # nsa: its cache functions


def _imports(folder: str) -> dict[str, set[str]]:
    found = {}
    for path in (ROOT / folder).rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)
        found[str(path.relative_to(ROOT))] = names
    return found


def test_models_use_the_public_kernel_functions_and_no_sharding():
    for path, names in _imports("jaxagent/models").items():
        kernels = {n for n in names if n.split(".")[0] == "pallas_kernels"}
        assert kernels <= PUBLIC_KERNELS, (path, kernels - PUBLIC_KERNELS)
        assert not {n for n in names if n.split(".")[0] == "sharding"}, path


def test_kernels_import_no_jaxagent():
    for path, names in _imports("pallas_kernels").items():
        assert not {n for n in names if n.split(".")[0] == "jaxagent"}, path
