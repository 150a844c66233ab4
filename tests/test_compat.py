"""raytune_ft/compat/: every private name of Ray, torch, MLflow and transformers the package uses loads on
the installed versions; one that moved fails with the installed version named; the patches do what they say
and only where they are needed. (tests/test_structure.py holds the rest of the package to compat.)"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re

import pytest

from raytune_ft import compat
def test_every_internal_loads_and_says_why_and_where_it_was_checked():
    entries = compat.internals()
    assert len(entries) >= 12
    for name, entry in entries.items():
        assert entry.load() is not None, name
        assert len(entry.why) > 20 and entry.package in entry.known, name


def test_a_missing_internal_fails_naming_the_installed_version():
    gone = compat.Internal("ray", "ray.train", ("_no_such_name",), compat.RAY, why="for this test")
    with pytest.raises(compat.CompatError, match=re.escape(f"ray {importlib.metadata.version('ray')}: ray.train._no_such_name")):
        gone.load()
    moved = compat.Internal("torch", "torch._no_such_module", ("x",), compat.TORCH, why="for this test")
    with pytest.raises(compat.CompatError, match=re.escape(f"torch {importlib.metadata.version('torch')}")):
        moved.load()


def test_the_quieted_ray_loggers_are_named_after_modules_that_exist():
    """A logger named after a module Ray renamed would quietly stop being quieted."""
    import ray

    for name in (*compat.RAY_QUIET_LOGGERS, compat.RAY_TRAIN_FN_ERROR_LOGGER):
        assert importlib.util.find_spec(name) is not None, name
    assert os.path.isfile(os.path.join(os.path.dirname(ray.__file__), *compat.RAY_REPORT_LOGGER_FILE))


def test_the_stager_patch_applies_only_to_the_torch_versions_that_close_it(monkeypatch):
    import torch
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    for version, closes in (("2.10.0", False), ("2.11.0+cu130", True), ("2.12.1", True), ("2.13.0+cpu", False)):
        monkeypatch.setattr(torch, "__version__", version)
        assert compat.torch_internals._stager_closes_copier() is closes, version
    monkeypatch.setattr(torch, "__version__", "2.11.0")
    stager = DefaultStager(StagingOptions(False, False, False, False))
    close = compat.keep_stager_buffers(stager)
    stager._state_dict_stager.close()                  # what 2.11's _stage does after each stage: held back
    assert stager._state_dict_stager._deepcopy_dispatch
    close()
    assert not stager._state_dict_stager._deepcopy_dispatch

    class Changed:                                     # a torch whose stager holds its copier elsewhere
        pass

    with pytest.raises(compat.CompatError, match="torch 2.11.0: DefaultStager has no _state_dict_stager"):
        monkeypatch.setattr(compat.torch_internals, "installed", lambda package: f"{package} {torch.__version__}")
        compat.keep_stager_buffers(Changed())


def test_the_trainer_methods_the_trl_loop_overrides_are_there():
    from transformers import Trainer

    assert compat.check_trainer_internals(Trainer) is Trainer
    with pytest.raises(compat.CompatError, match="Trainer has no _maybe_log_save_evaluate"):
        compat.check_trainer_internals(type("Renamed", (), {}))


def test_mlflow_target_puts_the_previous_stores_back(tmp_path):
    import mlflow

    before = mlflow.get_tracking_uri()
    target = f"sqlite:///{tmp_path / 'target.db'}"
    with compat.mlflow_target(target, None):
        assert mlflow.get_tracking_uri() == target and mlflow.get_registry_uri() == target
        with compat.mlflow_registration_prints_off():
            from mlflow.tracking._model_registry import fluent

            fluent.eprint("not printed")
    assert mlflow.get_tracking_uri() == before


def test_a_workers_error_is_found_inside_ray_trains_wrapping_of_it():
    """train/launch.unfixable_error looks through Ray Train's wrapper (a private attribute, through compat)."""
    from raytune_ft.driver.launch import unfixable_error
    from raytune_ft.recipe.values import RecipeError

    wrapper = compat.RAY_WRAPPED_ERROR.load()
    inner = RecipeError("bad recipe")
    assert compat.ray_wrapped_error(wrapper(inner, "Traceback ...")) is inner
    assert compat.ray_wrapped_error(ValueError("plain")) is None
    assert unfixable_error(RuntimeError("attempt failed")) is None
    outer = RuntimeError("worker group failed")
    outer.__cause__ = wrapper(inner, "Traceback ...")
    assert unfixable_error(outer) is inner


def test_torchaos_weight_wrappers_give_their_high_precision_tensor():
    """train/fp8's eval, samples and checkpoints read the tensor inside torchao's float8 weight (torchao 0.18, a
    dev dependency: its float8 wrappers build on CPU)."""
    import torch
    from torchao.float8.config import Float8LinearConfig
    from torchao.float8.float8_training_tensor import LinearMMConfig
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from raytune_ft.train.fp8 import plain_tensor

    assert Float8LinearConfig is not None
    w = torch.randn(4, 8)
    wrapped = WeightWithDynamicFloat8CastTensor(w, LinearMMConfig(), torch.float8_e4m3fn)
    assert isinstance(wrapped, compat.torchao_weight_wrappers())
    assert compat.torchao_inner_tensor(wrapped) is w
    assert plain_tensor(wrapped) is w and plain_tensor(w) is w


def test_a_models_attention_implementation_is_read_and_set_through_transformers():
    from transformers import AutoModelForCausalLM

    from raytune_ft.models.gated_delta import enable_packing
    from raytune_ft.models.tiny import tiny_config

    model = AutoModelForCausalLM.from_config(tiny_config("qwen3", 300), attn_implementation="eager")
    assert compat.attn_implementation(model.config) == "eager"
    enable_packing(model, "sdpa")
    assert compat.attn_implementation(model.config) == "sdpa"
    with pytest.raises(compat.CompatError, match="has no _attn_implementation"):
        compat.attn_implementation(object())


def test_every_private_attribute_is_found_on_its_class_and_one_gone_fails_naming_the_version():
    entries = compat.private_attrs()
    assert {"TORCH_DTENSOR_LOCAL", "TRAINER_LAST_LOGGED", "RAY_DATA_CONFIG_SPLIT", "RAY_DATA_CONFIG_OPTIONS"} <= set(entries)
    for name, entry in entries.items():
        assert isinstance(entry.check(), type), name
        assert len(entry.why) > 20 and entry.package in entry.known, name
    gone = compat.PrivateAttr("transformers", "transformers", "Trainer", "_no_such_step", compat.TRANSFORMERS,
                              named_in="_maybe_log_save_evaluate", why="for this test")
    with pytest.raises(compat.CompatError, match=re.escape(
            f"transformers {importlib.metadata.version('transformers')}: transformers.Trainer._maybe_log_save_evaluate "
            "names no _no_such_step")):
        gone.check()
    with pytest.raises(compat.CompatError, match="has no _no_such_step"):
        gone.read(object())


def test_a_method_another_library_wrapped_in_place_is_still_read_through_its_wrapper(monkeypatch):
    """torch's dynamo wraps nn.Module.__init__ in place in every process that compiles (mutation_guard's
    generation tagging); the check reads through the wrapper's closure, as the suite's whole run met it."""
    import torch

    from torch._dynamo.mutation_guard import install_generation_tagging_init

    monkeypatch.setattr(torch.nn.Module, "__init__", torch.nn.Module.__init__)
    monkeypatch.setattr(torch.nn.Module, "__setstate__", torch.nn.Module.__setstate__)
    monkeypatch.setattr(torch.nn.Module, "___needs_generation_tag_patch", True, raising=False)
    install_generation_tagging_init()
    assert "_non_persistent_buffers_set" not in torch.nn.Module.__init__.__code__.co_consts     # the wrapper's own
    entry = compat.private_attrs()["TORCH_NON_PERSISTENT_BUFFERS"]
    assert entry.check() is torch.nn.Module


def test_a_private_attribute_is_read_and_set_through_compat_only_where_it_is():
    from ray.train import DataConfig

    config = compat.ray_data_config()(datasets_to_split=["train"])
    assert compat.RAY_DATA_CONFIG_SPLIT.read(config) == ["train"]
    assert compat.RAY_DATA_CONFIG_OPTIONS.read(config)("train") is not None
    assert compat.ray_data_config() is DataConfig

    class Holder:
        _created_lr_scheduler = False

    holder = Holder()
    compat.TRAINER_SCHEDULER_CREATED.write(holder, True)
    assert holder._created_lr_scheduler is True
    with pytest.raises(compat.CompatError, match="has no _created_lr_scheduler"):
        compat.TRAINER_SCHEDULER_CREATED.write(object(), True)    # a name nothing reads: not set quietly


def test_an_s3_filesystems_options_are_read_from_its_pickled_form_or_fail_loudly():
    import pyarrow.fs as pafs

    fs = pafs.S3FileSystem(endpoint_override="localhost:9", scheme="http", anonymous=True, connect_timeout=20.0)
    assert compat.s3_options(fs)["endpoint_override"] == "localhost:9"
    quick = compat.s3_rebuilt(fs, connect_timeout=1.5)
    assert compat.s3_options(quick)["connect_timeout"] == 1.5
    assert compat.s3_options(quick)["endpoint_override"] == "localhost:9" and compat.s3_options(quick)["scheme"] == "http"

    class Changed:                                   # a pyarrow whose filesystem pickles otherwise
        def __reduce__(self):
            return (Changed, ())

    with pytest.raises(compat.CompatError, match=re.escape(f"pyarrow {importlib.metadata.version('pyarrow')}")):
        compat.s3_options(Changed())


@pytest.mark.timeout(120)
def test_a_submitted_jobs_start_is_read_from_rays_job_table(ray_local):
    """driver/start_ahead.submitted_at reads Ray's own record of a submission: a record of another form
    fails naming Ray's version, where it was read as 'no start time' before."""
    import json

    kv_get, kv_put, kv_del = compat.RAY_INTERNAL_KV.load()
    key = compat.RAY_JOB_INFO.load().JOB_DATA_KEY
    namespace = compat.RAY_JOB_TABLE.load()
    assert compat.ray_job_started_at("raysubmit_none_such") is None
    try:
        kv_put(key.format(job_id="raysubmit_t1"), json.dumps({"start_time": 1700000000123}), namespace=namespace)
        assert compat.ray_job_started_at("raysubmit_t1") == pytest.approx(1700000000.123)
        kv_put(key.format(job_id="raysubmit_t1"), "not json", overwrite=True, namespace=namespace)
        with pytest.raises(compat.CompatError, match=re.escape(f"ray {importlib.metadata.version('ray')}")):
            compat.ray_job_started_at("raysubmit_t1")
    finally:
        kv_del(key.format(job_id="raysubmit_t1"), namespace=namespace)
    assert kv_get(key.format(job_id="raysubmit_t1"), namespace=namespace) is None


def test_the_overridden_ray_trainer_method_is_checked():
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    assert compat.check_ray_trainer_internals(DataParallelTrainer) is DataParallelTrainer
    with pytest.raises(compat.CompatError, match="DataParallelTrainer has no _initialize_and_run_controller"):
        compat.check_ray_trainer_internals(type("Renamed", (), {}))
