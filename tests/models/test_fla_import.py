"""flash-linear-attention's ops imported without its package __init__ (gated_delta.import_fla_ops_only).

flash-linear-attention is a GPU-only package (the [gpu] extra) and breaks the Qwen3.5 layers on a CPU
machine, so these tests run a stand-in package of the same layout in a fresh process: an __init__ that,
like fla's, imports its heavy layer and model modules and re-exports them, an `fla.ops` __init__ that, like
fla 0.6's, imports every op, and ops modules that either need nothing of those __init__s (fla 0.6) or
something only one of them defines (a release this must not break).
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.conftest import REPO, env_with_path

PROBE = textwrap.dedent("""
    import json, sys
    from raytune_ft.models.gated_delta import import_fla_ops_only, _fla_chunk_gated_delta_rule
    light = import_fla_ops_only()
    fn = _fla_chunk_gated_delta_rule()
    import fla
    print(json.dumps({"light": light, "init_ran": "fla.layers" in sys.modules, "version": fla.__version__,
                      "op": fn(3) if fn else None, "fla_modules": "fla.modules" in sys.modules,
                      "other_ops": "fla.ops.rwkv7" in sys.modules}))
""")


def _stand_in(root: Path, *, op_needs_init: str = "") -> None:
    """op_needs_init: "" (fla 0.6), "fla" or "fla.ops": the package whose __init__ defines a name the op takes."""
    pkg = root / "fla"
    for sub in ("ops/gated_delta_rule", "modules", "layers"):
        (pkg / sub).mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(
        "from pkgutil import extend_path\n__path__ = extend_path(__path__, __name__)\n__version__ = '0.6.0'\n"
        "import fla.layers\nFROM_INIT = 2\n")
    (pkg / "layers" / "__init__.py").write_text("HEAVY = True\n")
    (pkg / "ops" / "__init__.py").write_text("from .rwkv7 import chunk_rwkv7\nOPS_INIT = 2\n")
    (pkg / "ops" / "rwkv7.py").write_text("def chunk_rwkv7(x):\n    return x\n")
    (pkg / "modules" / "__init__.py").write_text("class FusedRMSNormGated: pass\n")
    body = {"": "FROM_INIT = 2\n", "fla": "from fla import FROM_INIT\n",
            "fla.ops": "from fla.ops import OPS_INIT as FROM_INIT\n"}[op_needs_init]
    (pkg / "ops" / "gated_delta_rule" / "__init__.py").write_text(
        body + "def chunk_gated_delta_rule(x):\n    return x * FROM_INIT\n")
    dist = root / "fla_core-0.6.0.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fla-core\nVersion: 0.6.0\n")


def _probe(root: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE], env=env_with_path(root, REPO), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_ops_import_without_the_package_init(tmp_path):
    _stand_in(tmp_path)
    got = _probe(tmp_path)
    assert got == {"light": True, "init_ran": False, "version": "0.6.0", "op": 6, "fla_modules": True,
                   "other_ops": False}


def test_ops_that_need_the_package_init_get_it(tmp_path):
    """A release whose ops import a name of the package's __init__: the partial package goes, fla imports
    whole, and the op works as it did before."""
    for needs in ("fla", "fla.ops"):
        root = tmp_path / needs
        _stand_in(root, op_needs_init=needs)
        got = _probe(root)
        assert got == {"light": False, "init_ran": True, "version": "0.6.0", "op": 6, "fla_modules": False,
                       "other_ops": True}, needs
