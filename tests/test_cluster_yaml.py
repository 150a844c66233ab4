"""cluster.yaml: valid for Ray's cluster launcher, GPU node types as documented, closed to the network."""
from __future__ import annotations

import copy
import re
import shlex
import tomllib

import pytest
import yaml

from tests.conftest import REPO

CLUSTER_YAML = REPO / "cluster.yaml"


@pytest.fixture(scope="module")
def cfg() -> dict:
    with open(CLUSTER_YAML) as f:
        return yaml.safe_load(f)


def _prepared(cfg: dict) -> dict:
    """The config as `ray up` sees it: merged with the provider defaults, then validated."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(cfg))
    validate_config(prepared)
    return prepared


def _ray_start_args(command: str) -> list[str]:
    """The arguments of the `ray start` in one shell command line (which may export variables first)."""
    for part in command.split(";"):
        words = shlex.split(part.strip())
        if words[:2] == ["ray", "start"]:
            return words[2:]
    return []


def _exports(command: str) -> dict[str, str]:
    out = {}
    for part in command.split(";"):
        words = shlex.split(part.strip())
        if words[:1] == ["export"]:
            out.update(w.split("=", 1) for w in words[1:])
    return out


def test_valid_against_ray_cluster_config_schema(cfg):
    import json

    import jsonschema
    import ray.autoscaler

    # the file as written, against the schema Ray ships...
    with open(f"{ray.autoscaler.__path__[0]}/ray-schema.json") as f:
        jsonschema.validate(cfg, json.load(f))
    # ...and after the launcher's own preparation, with Ray's validator
    prepared = _prepared(cfg)
    assert prepared["head_node_type"] == "ray.head.cpu"


def test_validator_rejects_a_broken_config(cfg):
    """The check above can fail: an unknown field or a node type without resources is refused."""
    import jsonschema

    bad = copy.deepcopy(cfg)
    bad["dashboard_host"] = "0.0.0.0"
    with pytest.raises(jsonschema.ValidationError):
        _prepared(bad)
    bad = copy.deepcopy(cfg)
    del bad["available_node_types"]["ray.worker.b300"]["resources"]
    with pytest.raises(jsonschema.ValidationError):
        _prepared(bad)


def test_gpu_node_types_b300_and_h100(cfg):
    types = cfg["available_node_types"]
    head = types[cfg["head_node_type"]]
    assert "GPU" not in head["resources"]
    gpu = {name: t for name, t in types.items() if t["resources"].get("GPU")}
    assert {t["node_config"]["InstanceType"] for t in gpu.values()} == {"p6-b300.48xlarge", "p5.48xlarge"}
    for t in gpu.values():
        assert t["resources"]["GPU"] == 8
        assert t.get("min_workers", 0) == 0   # GPU nodes start only when a job asks for them
    accel = {k for t in gpu.values() for k in t["resources"] if k.startswith("accelerator_type:")}
    assert accel == {"accelerator_type:B300", "accelerator_type:H100"}
    assert sum(t.get("max_workers", 0) for t in gpu.values()) <= cfg["max_workers"]


def test_setup_installs_project_with_gpu_extra_on_gpu_nodes(cfg):
    with open(REPO / "pyproject.toml", "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert "gpu" in extras
    names = {re.split(r"[<>=;\[ ]", d, maxsplit=1)[0] for d in extras["gpu"]}
    # what the start-up kernel check verifies on the node, plus tilelang (fla's Hopper backward) and torchao
    assert {"liger-kernel", "flash-linear-attention", "causal-conv1d", "tilelang", "torchao"} <= names
    prepared = _prepared(cfg)
    worker = " && ".join(prepared["worker_setup_commands"])
    head = " && ".join(prepared["head_setup_commands"])
    assert re.search(r"pip install .*-e .*raytune_ft\[gpu\]", worker), worker
    assert re.search(r"pip install .*-e .*raytune_ft", head) and "[gpu]" not in head, head
    assert "torch==" in worker  # pinned torch first, as the Makefile does
    assert cfg["file_mounts"]["~/raytune_ft"] == "."
    assert "/mnt/shared" in worker  # the shared storage every node sees


def test_dashboard_on_head_loopback_and_token_auth_on(cfg):
    from ray.scripts.scripts import start

    head_cmds = [c for c in cfg["head_start_ray_commands"] if _ray_start_args(c)]
    worker_cmds = [c for c in cfg["worker_start_ray_commands"] if _ray_start_args(c)]
    assert len(head_cmds) == 1 and len(worker_cmds) == 1
    head_args = _ray_start_args(head_cmds[0])
    # every flag is one `ray start` knows (click refuses unknown options)
    params = start.make_context("start", list(head_args)).params
    assert params["head"] and params["dashboard_host"] == "127.0.0.1"
    worker_args = [a.replace("$RAY_HEAD_IP", "10.0.0.1") for a in _ray_start_args(worker_cmds[0])]
    assert start.make_context("start", worker_args).params["address"] == "10.0.0.1:6379"
    text = CLUSTER_YAML.read_text()
    assert "0.0.0.0" not in text
    assert "RAY_AUTH_MODE=disabled" not in text
    for c in head_cmds + worker_cmds:
        assert _exports(c).get("RAY_AUTH_MODE") == "token", c
    # the token reaches every node from the machine that runs `ray up`
    assert cfg["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"


def test_worker_environment_for_nccl(cfg):
    env = _exports([c for c in cfg["worker_start_ray_commands"] if _ray_start_args(c)][0])
    assert env["FI_PROVIDER"] == "efa" and env["FI_EFA_USE_DEVICE_RDMA"] == "1"
    assert env["NCCL_SOCKET_IFNAME"].startswith("^lo")   # NCCL's bootstrap never on loopback
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"  # a dead peer raises instead of hanging
