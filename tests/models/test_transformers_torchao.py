"""compat.transformers_without_torchao: transformers' torchao check answers False inside the block
only; afterwards it answers truly again in every transformers module, those imported inside the block
(each binds its own name for the check) included. In a fresh process: the block is without effect where
transformers' quantizers are imported already, as they are in a test session."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO, env_with_path

pytest.importorskip("torchao", reason="torchao is in the dev extra: pip install -e '.[dev]'")

CHILD = """
import json, sys
from raytune_ft.compat import transformers_without_torchao
with transformers_without_torchao("bf16"):
    import transformers.quantizers, transformers.utils.quantization_config, transformers.integrations.torchao
    inside = transformers.utils.quantization_config.is_torchao_available()
from transformers.utils import import_utils
still_false = sorted(name for name, m in list(sys.modules.items()) if name.startswith("transformers")
                     and callable(getattr(m, "is_torchao_available", None)) and not m.is_torchao_available())
print(json.dumps({"inside": inside, "after": import_utils.is_torchao_available(), "still_false": still_false}))
"""


@pytest.mark.timeout(240)
def test_the_torchao_check_answers_truly_again_after_the_block():
    out = subprocess.run([sys.executable, "-c", CHILD], env=env_with_path(REPO), capture_output=True, text=True,
                         timeout=220)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"inside": False, "after": True, "still_false": []}
