"""FSDP2 through Ray Train on every GPU of the machine: the 27B recipe's --local job (tiny qwen3_5 model,
generated chat data) moved onto the GPUs (bf16 compute, fp32 master weights, NCCL).

Three runs on one local Ray, as tests/train/test_fault_tolerance.py does on CPU:
- "straight": 8 steps, a checkpoint at step 4, the final one (with the hf/ export) at step 8;
- "resumed": the same recipe whose rank 0 exits right after uploading its part of the step-8 checkpoint,
  before Ray registers it (tests/faults.py, exit_after_upload); with max_failures=0 the run fails and step 4's
  checkpoint stays the latest; then the same run submitted again, which resumes from step 4.
The resumed run's per-step losses must match the straight run's within LOSS_REL (bf16 compute: the unit
roundoff is 3.9e-3, and the GPU kernels' backward passes are not bitwise deterministic), its data position
too; the final hf/ export must load in transformers on the GPU with every weight in place and generate.
"""
from __future__ import annotations

import glob
import json
import math
import os

import pytest
import torch

from tests.conftest import run_with_fault, train_state
from tests.faults import RUNTIME_ENV

STEPS, EVERY = 8, 4
LOSS_REL = 1e-2
WEIGHT_REL = 2e-2


def _recipe(storage, run_name: str, ngpu: int):
    from raytune_ft.cli import _job_recipe

    return _job_recipe("qwen27b_b300", True, [
        f"tracking.storage_path={storage}", f"tracking.run_name={run_name}", "registry.enabled=false",
        f"train.max_steps={STEPS}", f"train.checkpoint_every={EVERY}", "train.log_every=1",
        f"data.source=builtin:chat:{max(600, 160 * ngpu)}",
        "scaling.use_gpu=true", f"scaling.num_workers={ngpu}", f"scaling.gpus_per_node={ngpu}",
        "scaling.backend=nccl", "scaling.max_failures=0", "model.dtype=bfloat16"])


@pytest.fixture(scope="module")
def gpu_runs(tmp_path_factory):
    import ray

    from raytune_ft.driver.run import run

    ngpu = torch.cuda.device_count()
    storage = tmp_path_factory.mktemp("gpu_runs")
    out: dict = {"ngpu": ngpu}
    ray.init(address="local", num_cpus=max(8, 2 * ngpu + 4), num_gpus=ngpu, include_dashboard=False,
             runtime_env=RUNTIME_ENV)    # the tests' fault plan reaches the workers (tests/faults.py)
    try:
        out["straight"] = run(_recipe(storage, "straight", ngpu), local=True)
        resumed = _recipe(storage, "resumed", ngpu)
        out["fault_error"] = run_with_fault(resumed, dict(exit_after_upload=f"{STEPS}:0"))   # meant to fail
        out["resumed"] = run(resumed, local=True)
    finally:
        ray.shutdown()
    return out


@pytest.mark.timeout(900)
def test_resume_matches_the_uninterrupted_run(gpu_runs):
    assert gpu_runs["fault_error"] is not None, "rank 0 was meant to die in the step-8 checkpoint window"
    straight, resumed = gpu_runs["straight"], gpu_runs["resumed"]
    assert straight.steps == STEPS and resumed.steps == STEPS
    a, b = train_state(straight.checkpoint), train_state(resumed.checkpoint)
    assert b.get("resumed_from") == [EVERY], b.get("resumed_from")
    assert [h["step"] for h in a["history"]] == [h["step"] for h in b["history"]] == list(range(1, STEPS + 1))
    worst = max(abs(x["loss"] - y["loss"]) / abs(x["loss"]) for x, y in zip(a["history"], b["history"]))
    print("RESULT " + json.dumps({"gpus": gpu_runs["ngpu"], "straight": [h["loss"] for h in a["history"]],
                                  "resumed": [h["loss"] for h in b["history"]], "loss_rel_max": worst}))
    assert worst <= LOSS_REL, worst
    assert all(math.isfinite(h["loss"]) for h in b["history"])
    assert a["blocks_consumed"] == b["blocks_consumed"]
    # every rank trained: each rank's own state is in the final checkpoint
    assert len(glob.glob(os.path.join(resumed.checkpoint, "train_state", "rank*.json"))) == gpu_runs["ngpu"]


@pytest.mark.timeout(900)
def test_hf_export_loads_in_transformers_on_the_gpu(gpu_runs, cuda):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    models = {}
    for name in ("straight", "resumed"):
        hf = os.path.join(gpu_runs[name].checkpoint, "hf")
        lm, info = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.bfloat16, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        models[name] = lm.to(cuda).eval()
    assert type(models["resumed"]).__name__ == "Qwen3_5ForCausalLM"
    tok = AutoTokenizer.from_pretrained(os.path.join(gpu_runs["resumed"].checkpoint, "hf"))
    text = tok.apply_chat_template([{"role": "user", "content": "What is packing?"}], tokenize=False,
                                   add_generation_prompt=True)
    ids = tok(text, return_tensors="pt").input_ids.to(cuda)
    with torch.no_grad():
        out = models["resumed"](ids, labels=ids)
        gen = models["resumed"].generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.isfinite(out.loss) and torch.isfinite(out.logits).all()
    assert gen.shape[1] == ids.shape[1] + 8 or tok.eos_token_id in gen[0, ids.shape[1]:].tolist()
    # the resumed run's weights are the uninterrupted run's
    worst = 0.0
    sa = dict(models["straight"].named_parameters())
    with torch.no_grad():
        for k, p in models["resumed"].named_parameters():
            ref = sa[k].float()
            worst = max(worst, float((p.float() - ref).norm() / ref.norm().clamp(min=1e-30)))
    print("RESULT " + json.dumps({"export_weight_rel_max": worst}))
    assert worst <= WEIGHT_REL, worst


def test_the_loop_ran_the_kernel_check_and_tagged_it(gpu_runs):
    import mlflow

    from raytune_ft.models.kernel_check import TAG_IN_USE

    s = gpu_runs["resumed"]
    tags = mlflow.MlflowClient(s.tracking_uri).get_run(s.mlflow_run_id).data.tags
    print("RESULT " + json.dumps({k: v for k, v in tags.items() if k.startswith("raytune.kernels")}))
    kernels = dict(x.split("=") for x in tags[TAG_IN_USE].split(", "))
    assert set(kernels) == {"attention", "gdn_conv", "gdn_recurrence"}
    # on a GPU the fast path is used unless the check switched it off (then the tag says why)
    if kernels["attention"] == "sdpa_blockdiag":
        assert "raytune.kernels_off" in tags
