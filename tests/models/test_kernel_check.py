"""The start-up kernel check's logic on CPU (models/kernel_check.py).

The fast kernels it guards (FlashAttention, torch varlen, fla, causal-conv1d, Liger) do not run on a CPU,
so these tests hand the check CPU stand-ins through the same registry the loop uses (fast_paths.py: attention_path,
conv_path, recurrence_path, fused_ce_path at a tiny qwen3_5 config): one correct (the project's own CPU
paths), one that returns wrong values, one that raises, one that leaks across a conversation boundary.
Each bad one must be caught, switched off for the process, logged in one line and recorded in the MLflow
run (a real sqlite store); strict mode must stop with a clear error. The real kernels are checked by the
GPU suite (tests/gpu).
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from raytune_ft.models import fast_paths as fp
from raytune_ft.models import kernel_check as kc
from raytune_ft.models.attention import (QKV, DISABLED_KERNELS, disable_kernel, reset_disabled_kernels,
                                         select_attention_backend, varlen_attention)
from raytune_ft.models.gated_delta import DeltaRuleInputs, segment_causal_conv1d, segment_gated_delta_rule
from raytune_ft.models.tiny import tiny_config

CFG = tiny_config("qwen3_5", 512)
F32 = torch.float32
ON_CPU = kc.KernelUse(CFG, "cpu", F32)     # the stand-ins, checked in fp32


# ----------------------------------------------------------------- stand-ins (CPU)

def good_attention(x, cu, max_len):
    return varlen_attention(QKV(x["q"], x["k"], x["v"]), cu, max_len, scaling=x["q"].shape[-1] ** -0.5,
                            backend="sdpa_blockdiag")


def wrong_attention(x, cu, max_len):
    """Right everywhere but conversation 3, as a kernel with a bad tile at one offset might be."""
    out = good_attention(x, cu, max_len)
    s = int(cu[2])
    return torch.cat([out[:s], out[s:] * 1.3])


def raising_attention(x, cu, max_len):
    raise RuntimeError("CUDA error: no kernel image is available for execution on the device")


def leaky_attention(x, cu, max_len):
    """Causal over the whole block: the packing boundaries are ignored (position_ids-only packing)."""
    return good_attention(x, cu[[0, -1]], max_len)


def noncausal_attention(x, cu, max_len):
    """Per conversation but not causal: varlen_attn without window_size=(-1, 0)."""
    outs, bounds = [], cu.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        q, k, v = (x[n][s:e].transpose(0, 1)[None] for n in "qkv")
        outs.append(F.scaled_dot_product_attention(q, k, v, enable_gqa=True)[0].transpose(0, 1))
    return torch.cat(outs)


def good_conv(x, cu, max_len):
    return segment_causal_conv1d(x["x"], x["w"], None, cu, backend="torch_segmented")


def leaky_conv(x, cu, max_len):
    return segment_causal_conv1d(x["x"], x["w"], None, cu[[0, -1]], backend="torch_segmented")


def good_recurrence(x, cu, max_len):
    return segment_gated_delta_rule(DeltaRuleInputs(x["q"], x["k"], x["v"], x["g"], x["beta"]), cu,
                                    backend="torch_per_segment")


def leaky_recurrence(x, cu, max_len):
    return segment_gated_delta_rule(DeltaRuleInputs(x["q"], x["k"], x["v"], x["g"], x["beta"]), cu[[0, -1]],
                                    backend="torch_per_segment")


def good_ce(x, cu, max_len):
    return F.cross_entropy(x["h"] @ x["w"].t(), x["labels"], ignore_index=-100, reduction="sum")


def mean_ce(x, cu, max_len):
    """Mean instead of sum: wrong by the token count, the kind of reduction slip a fused loss can have."""
    return F.cross_entropy(x["h"] @ x["w"].t(), x["labels"], ignore_index=-100)


K = fp.Kernel


def all_good_paths():
    return [fp.attention_path(CFG, [K("attn_ok", good_attention, ("torch",))]),
            fp.conv_path(CFG, [K("conv_ok", good_conv)]),
            fp.recurrence_path(CFG, [K("rec_ok", good_recurrence)]),
            fp.fused_ce_path(CFG, [K("ce_ok", good_ce)])]


@pytest.fixture(autouse=True)
def _clean_kernels():
    reset_disabled_kernels()
    yield
    reset_disabled_kernels()


@pytest.fixture(scope="module")
def mlflow_store(tmp_path_factory):
    import mlflow

    uri = f"sqlite:///{tmp_path_factory.mktemp('kc_mlflow')}/mlflow.db"
    client = mlflow.MlflowClient(uri)
    exp = client.create_experiment("kernel_check")
    return client, exp, uri


def new_run(store):
    client, exp, _ = store
    run_id = client.create_run(exp).info.run_id
    return run_id, (lambda k, v: client.set_tag(run_id, k, v)), (lambda: client.get_run(run_id).data.tags)


# ----------------------------------------------------------------- tests

def test_correct_stand_ins_pass_and_are_tagged(mlflow_store):
    run_id, tag, tags = new_run(mlflow_store)
    lines: list[str] = []
    report = kc.check_kernels(ON_CPU, paths=all_good_paths(), log_line=lines.append, tag=tag)
    assert report.checked and report.failures == []
    assert report.in_use == {"attention": "attn_ok", "gdn_conv": "conv_ok", "gdn_recurrence": "rec_ok",
                             "fused_ce": "ce_ok"}
    assert max(report.errors.values()) <= 1e-5, report.errors
    assert not DISABLED_KERNELS
    assert lines == [report.summary()] and "checked in" in lines[0]
    t = tags()
    assert t[kc.TAG_IN_USE] == "attention=attn_ok, gdn_conv=conv_ok, gdn_recurrence=rec_ok, fused_ce=ce_ok"
    assert kc.TAG_OFF not in t


@pytest.mark.parametrize("bad, what, detail", [
    (wrong_attention, "wrong values", "conversation 3 of 3"),
    (noncausal_attention, "wrong values", "rel error"),
    (raising_attention, "raised", "RuntimeError: CUDA error: no kernel image"),
    (leaky_attention, "leaks across a boundary", "later conversations' outputs"),
])
def test_bad_attention_is_caught_switched_off_logged_and_tagged(mlflow_store, bad, what, detail):
    run_id, tag, tags = new_run(mlflow_store)
    lines: list[str] = []
    # the bad kernel is preferred ("torch_varlen", a real name so the hook is exercised); the good one is next
    path = fp.attention_path(CFG, [K("torch_varlen", bad, ("torch",)), K("attn_ok", good_attention)])
    report = kc.check_kernels(ON_CPU, paths=[path], log_line=lines.append, tag=tag)

    assert [(f.kernel, f.what) for f in report.failures] == [("torch_varlen", what)]
    assert detail in report.failures[0].detail
    assert report.in_use == {"attention": "attn_ok"}
    # switched off for the process: the loop's own selection no longer picks it on a GPU
    assert "torch_varlen" in DISABLED_KERNELS
    assert select_attention_backend("cuda") != "torch_varlen"
    # one line for the failure, naming the kernel, the versions, the error and the path used instead
    failure_lines = [x for x in lines if "switched off" in x]
    assert len(failure_lines) == 1, lines
    line = failure_lines[0]
    assert line.startswith("kernel check: torch_varlen (full attention) switched off for this run: " + what)
    assert f"torch {torch.__version__}" in line and detail in line and line.endswith("using attn_ok instead")
    t = tags()
    assert t[kc.TAG_IN_USE] == "attention=attn_ok"
    assert t[kc.TAG_OFF].startswith(f"torch_varlen: {what}")


@pytest.mark.parametrize("path_fn, bad, good, name", [
    (fp.conv_path, leaky_conv, good_conv, "causal_conv1d"),
    (fp.recurrence_path, leaky_recurrence, good_recurrence, "fla_chunk"),
])
def test_gated_delta_leaks_are_caught(monkeypatch, path_fn, bad, good, name):
    from raytune_ft.models import gated_delta as gd

    # pretend the CUDA packages are installed, so the selection's switch-off can be seen on a CPU machine
    monkeypatch.setattr(gd, "_causal_conv1d_fn", lambda: good)
    monkeypatch.setattr(gd, "_fla_chunk_gated_delta_rule", lambda: good)
    assert name in gd.gated_delta_backends("cuda").values()
    lines: list[str] = []
    fallback = path_fn(CFG, []).fallback
    report = kc.check_kernels(ON_CPU, paths=[path_fn(CFG, [K(name, bad)])], log_line=lines.append)
    assert [(f.kernel, f.what) for f in report.failures] == [(name, "leaks across a boundary")]
    assert report.in_use == {path_fn(CFG, []).name: fallback}
    assert name not in gd.gated_delta_backends("cuda").values()
    assert fallback in gd.gated_delta_backends("cuda").values()
    assert sum("switched off" in x for x in lines) == 1 and lines[0].endswith(f"using {fallback} instead")


def test_wrong_fused_loss_is_caught():
    report = kc.check_kernels(ON_CPU, paths=[fp.fused_ce_path(CFG, [K("liger", mean_ce)])],
                              log_line=lambda _: None)
    assert [(f.kernel, f.what) for f in report.failures] == [("liger", "wrong values")]
    assert report.in_use == {"fused_ce": "torch"}


def test_every_candidate_failing_falls_back_to_the_reference_path():
    path = fp.attention_path(CFG, [K("flash_attn", raising_attention), K("torch_varlen", leaky_attention)])
    lines: list[str] = []
    report = kc.check_kernels(ON_CPU, paths=[path], log_line=lines.append)
    assert [f.kernel for f in report.failures] == ["flash_attn", "torch_varlen"]
    assert report.in_use == {"attention": "sdpa_blockdiag"}
    assert {"flash_attn", "torch_varlen"} <= DISABLED_KERNELS
    assert select_attention_backend("cuda") == "sdpa_blockdiag"
    assert [x.endswith("using sdpa_blockdiag instead") for x in lines[:2]] == [True, True]


def test_strict_mode_stops_with_a_clear_error(mlflow_store):
    run_id, tag, tags = new_run(mlflow_store)
    path = fp.attention_path(CFG, [K("torch_varlen", wrong_attention, ("torch",)), K("attn_ok", good_attention)])
    with pytest.raises(kc.KernelCheckError) as err:
        kc.check_kernels(ON_CPU, mode="strict", paths=[path], log_line=lambda _: None, tag=tag)
    msg = str(err.value)
    assert msg.startswith("train.kernels=strict: the start-up kernel check failed on this GPU")
    assert "torch_varlen (full attention) failed: wrong values" in msg and f"torch {torch.__version__}" in msg
    assert "train.kernels=check" in msg and "attention=attn_ok" in msg
    assert not DISABLED_KERNELS                # the run stops: nothing was switched


def test_a_loop_worker_logs_through_its_worker_log_and_tags_its_run(mlflow_store):
    """check_on_worker, as both loops call it: rank 0's WorkerLog writes the line and tags the run."""
    import io

    from raytune_ft.recipe.recipe import Recipe
    from raytune_ft.train.common import WorkerLog

    client, exp, uri = mlflow_store
    run_id = client.create_run(exp).info.run_id
    recipe = Recipe()
    recipe.tracking.tracking_uri = uri
    out = io.StringIO()
    log = WorkerLog(0, recipe, run_id, stream=out)
    report = kc.check_on_worker(kc.KernelUse(CFG, torch.device("cpu"), F32), mode="check", log=log)
    log.close()                   # rank 0's MLflow calls are made by a process of their own
    assert not report.checked
    assert out.getvalue().startswith("[raytune_ft] kernels in use (no GPU")
    assert client.get_run(run_id).data.tags[kc.TAG_IN_USE] == ("attention=sdpa_blockdiag, gdn_conv=torch_segmented, "
                                                               "gdn_recurrence=torch_per_segment")
    quiet = io.StringIO()
    kc.check_on_worker(kc.KernelUse(CFG, torch.device("cpu"), F32), mode="check", log=WorkerLog(1, recipe, run_id, stream=quiet))
    assert quiet.getvalue() == ""          # the summary is rank 0's


def test_strict_mode_passes_when_every_kernel_is_right():
    report = kc.check_kernels(ON_CPU, mode="strict", paths=all_good_paths(), log_line=lambda _: None)
    assert report.failures == [] and report.in_use["attention"] == "attn_ok"


def test_bf16_tolerance_accepts_a_correct_kernel_in_bf16():
    """The stated bf16 bound is met by a correct kernel computing in bf16 (not only in fp32)."""
    report = kc.check_kernels(kc.KernelUse(CFG, "cpu", torch.bfloat16), paths=all_good_paths()[:3],
                              log_line=lambda _: None)
    assert report.failures == [], report.failures
    assert all(0 < v <= fp.TOLERANCE[k.split("/")[0]][torch.bfloat16] / 2 for k, v in report.errors.items()
               if not k.startswith("gdn_recurrence")), report.errors


def test_on_cpu_without_candidates_nothing_is_checked(mlflow_store):
    run_id, tag, tags = new_run(mlflow_store)
    lines: list[str] = []
    report = kc.check_kernels(kc.KernelUse(CFG, "cpu"), log_line=lines.append, tag=tag)
    assert not report.checked and report.failures == []
    assert report.in_use == {"attention": "sdpa_blockdiag", "gdn_conv": "torch_segmented",
                             "gdn_recurrence": "torch_per_segment"}
    assert "no GPU" in lines[0]
    assert tags()[kc.TAG_IN_USE] == "attention=sdpa_blockdiag, gdn_conv=torch_segmented, gdn_recurrence=torch_per_segment"


def test_off_mode_runs_nothing():
    path = fp.attention_path(CFG, [K("torch_varlen", raising_attention)])
    report = kc.check_kernels(kc.KernelUse(CFG, "cpu"), mode="off", paths=[path], log_line=lambda _: None)
    assert not report.checked and report.failures == [] and not DISABLED_KERNELS
    assert "train.kernels=off" in report.note


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="train.kernels must be one of check, strict, off"):
        kc.check_kernels(kc.KernelUse(CFG, "cpu"), mode="fast")


def test_qwen3_has_no_gated_delta_paths():
    cfg = tiny_config("qwen3", 512)
    assert [p.name for p in fp.default_paths(cfg)] == ["attention"]
    assert [p.name for p in fp.default_paths(CFG, liger=True)] == ["attention", "gdn_conv", "gdn_recurrence",
                                                                  "fused_ce"]


def test_the_switch_is_honoured_by_the_selection(monkeypatch):
    from raytune_ft.models import attention as att

    monkeypatch.setattr(att, "_flash_attn_varlen", lambda: object())
    att._backend_for.cache_clear()
    assert select_attention_backend("cuda") == "flash_attn"
    disable_kernel("flash_attn")
    assert select_attention_backend("cuda") != "flash_attn"
    assert select_attention_backend("cpu") == "sdpa_blockdiag"


# ----------------------------------------------------------------- across ranks (gloo, 2 processes)

def _rank_main(rank, world, port, q):
    from tests.conftest import spawned_gloo_rank

    with spawned_gloo_rank(rank, world, port):
        # rank 1 has a broken kernel (e.g. another GPU model in the job); rank 0's is fine
        first = wrong_attention if rank == 1 else good_attention
        path = fp.attention_path(CFG, [K("torch_varlen", first), K("attn_ok", good_attention)])
        lines: list[str] = []
        report = kc.check_kernels(ON_CPU, paths=[path], log_line=lines.append)
        q.put((rank, (report.in_use, sorted(DISABLED_KERNELS), lines)))
        q.close()
        q.join_thread()          # the queue's feeder thread has sent it before the rank leaves


@pytest.mark.timeout(180)
def test_a_kernel_failing_on_one_rank_is_off_on_every_rank():
    from tests.conftest import run_gloo_ranks

    got = run_gloo_ranks(_rank_main)
    for rank in (0, 1):
        assert got[rank][0] == {"attention": "attn_ok"} and got[rank][1] == ["torch_varlen"]
    # the failure is written once, by the rank that saw it; rank 0 writes the summary
    assert [x for x in got[1][2] if "switched off" in x and "wrong values" in x] == got[1][2]
    assert len(got[1][2]) == 1
    assert got[0][2] == ["kernels in use (checked in " + got[0][2][0].split("checked in ")[1]]


# ----------------------------------------------------------------- the context-parallel forms (issue 59)

def test_the_cp_forms_run_across_a_carried_chunk_and_pass_with_correct_kernels():
    """Under CP the check also runs each kernel the way models/context_parallel calls it, on a group of one:
    the check's block splits into two chunks inside its last conversation, so the recurrence starts the
    second chunk from the carried state, the conv reads the first chunk's tail and attention has more keys
    than queries. On CPU the candidates are the project's own paths by name (the CUDA kernels are the GPU
    suite's)."""
    from raytune_ft.models.context_parallel import make_shard

    total = sum(fp.CHECK_LENS)
    shard = make_shard(fp.cu_seqlens_of(fp.CHECK_LENS, "cpu"), total, 1, 0)
    assert shard.chunk_len == total // 2 and shard.carries(1)          # chunk 1 continues a conversation
    names = [K("sdpa_blockdiag", None), K("torch_segmented", None), K("torch_per_segment", None)]
    paths = fp.cp_paths(CFG, names)
    report = kc.check_kernels(ON_CPU, paths=paths, log_line=lambda _: None)
    assert report.failures == []
    assert report.in_use == {"cp_attention": "sdpa_blockdiag", "cp_gdn_conv": "torch_segmented",
                             "cp_gdn_recurrence": "torch_per_segment"}
    assert [p.name for p in fp.default_paths(CFG, context_parallel=True)][-3:] == [p.name for p in paths]
    assert not any(p.name.startswith("cp_") for p in fp.default_paths(CFG))


def test_a_cp_form_that_drops_the_carried_state_is_caught_and_its_kernel_switched_off(monkeypatch):
    import dataclasses
    import functools

    from raytune_ft.models import gated_delta as gd
    from raytune_ft.models.context_parallel.layout import CPShard

    monkeypatch.setattr(gd, "_fla_chunk_gated_delta_rule", lambda: good_recurrence)   # "installed"
    cp_form = next(p for p in fp.cp_paths(CFG, [K("torch_per_segment", None)]) if p.name == "cp_gdn_recurrence")
    broken = functools.partial(fp._cp_recurrence, backend="torch_per_segment")

    def dropped_state(x, cu, max_len):
        with monkeypatch.context() as m:         # no chunk continues a conversation: the state is lost
            m.setattr(CPShard, "carries", lambda self, chunk: False)
            return broken(x, cu, max_len)

    paths = [fp.recurrence_path(CFG, [K("fla_chunk", good_recurrence)]),
             dataclasses.replace(cp_form, candidates=[K("fla_chunk", dropped_state)])]
    report = kc.check_kernels(ON_CPU, paths=paths, log_line=lambda _: None)
    assert [(f.path, f.kernel, f.what) for f in report.failures] == [("cp_gdn_recurrence", "fla_chunk",
                                                                      "wrong values")]
    # one kernel, two call forms: the failed form switches it off for both, and the report says so
    assert report.in_use == {"gdn_recurrence": "torch_per_segment", "cp_gdn_recurrence": "torch_per_segment"}
    assert gd.gated_delta_backends("cuda")["recurrence"] == "torch_per_segment"


def test_recipe_field_defaults_to_check_and_is_validated():
    from raytune_ft.recipe.recipe import Recipe, RecipeError, apply_overrides, validate

    assert Recipe().train.kernels == "check"
    assert apply_overrides(Recipe(), ["train.kernels=strict"]).train.kernels == "strict"
    with pytest.raises(RecipeError, match=r"train.kernels: 'fast' is not one of 'check', 'strict', 'off'"):
        validate(apply_overrides(Recipe(), ["train.kernels=fast"]))


# ----------------------------------------------------------------- verdicts kept in the JIT cache (issue 60)

class Counted:
    """Stand-in kernels that count their runs."""

    def __init__(self):
        self.runs = 0

    def paths(self, attention=good_attention):
        def wrap(fn):
            def run(x, cu, max_len):
                self.runs += 1
                return fn(x, cu, max_len)
            return run
        return [fp.attention_path(CFG, [K("attn_ok", wrap(attention), ("torch",))]),
                fp.conv_path(CFG, [K("conv_ok", wrap(good_conv))])]


def test_an_all_pass_check_is_kept_and_the_next_start_recalls_it_without_running_a_kernel(tmp_path):
    use = kc.KernelUse(CFG, "cpu", F32, verdicts_dir=str(tmp_path))
    first = Counted()
    r1 = kc.check_kernels(use, paths=first.paths(), log_line=lambda _: None)
    assert first.runs > 0 and r1.failures == [] and r1.note == ""
    assert len(list(tmp_path.glob("*.json"))) == 1
    again = Counted()
    lines: list[str] = []
    r2 = kc.check_kernels(use, paths=again.paths(), log_line=lines.append)
    assert again.runs == 0, "a kept all-pass verdict of the same key runs no kernel"
    assert r2.in_use == r1.in_use and r2.errors == pytest.approx(r1.errors) and r2.checked
    assert "from the JIT cache" in lines[0] and "kernels in use" in lines[0]


def test_a_failed_check_is_not_kept_and_another_key_runs_the_check_again(tmp_path):
    use = kc.KernelUse(CFG, "cpu", F32, verdicts_dir=str(tmp_path))
    bad = Counted()
    r = kc.check_kernels(use, paths=bad.paths(attention=wrong_attention), log_line=lambda _: None)
    assert r.failures and not list(tmp_path.glob("*.json")), "a failure is checked again next start, not kept"
    reset_disabled_kernels()
    kc.check_kernels(use, paths=Counted().paths(), log_line=lambda _: None)
    assert len(list(tmp_path.glob("*.json"))) == 1
    for other in (kc.KernelUse(CFG, "cpu", torch.bfloat16, verdicts_dir=str(tmp_path)),      # another dtype
                  kc.KernelUse(CFG, "cpu", F32, context_parallel=True, verdicts_dir=str(tmp_path))):
        c = Counted()
        kc.check_kernels(other, paths=c.paths(), log_line=lambda _: None)
        assert c.runs > 0, other
    c = Counted()                     # another candidate list: a kernel added to a path
    paths = c.paths()
    paths[0].candidates.append(K("attn_also", good_attention))
    kc.check_kernels(use, paths=paths, log_line=lambda _: None)
    assert c.runs > 0
    # a torn record is not a verdict
    for f in tmp_path.glob("*.json"):
        f.write_text("{")
    c = Counted()
    kc.check_kernels(use, paths=c.paths(), log_line=lambda _: None)
    assert c.runs > 0


def _verdict_rank_main(rank, world, port, q):
    """Rank 0's node holds a kept verdict, rank 1's does not: both must run the check (its collectives
    match) rather than rank 0 recalling alone."""
    import tempfile

    from tests.conftest import spawned_gloo_rank

    folder = tempfile.mkdtemp(prefix=f"verdicts{rank}_")
    use = kc.KernelUse(CFG, "cpu", F32, verdicts_dir=folder)
    if rank == 0:
        kc.check_kernels(use, paths=Counted().paths(), log_line=lambda _: None)    # before the group: kept
    with spawned_gloo_rank(rank, world, port):
        c = Counted()
        report = kc.check_kernels(use, paths=c.paths(), log_line=lambda _: None)
        q.put((rank, (c.runs, report.in_use, len(os.listdir(folder)))))
        q.close()
        q.join_thread()


@pytest.mark.timeout(180)
def test_ranks_recall_kept_verdicts_only_when_every_rank_holds_one():
    from tests.conftest import run_gloo_ranks

    got = run_gloo_ranks(_verdict_rank_main)
    for rank in (0, 1):
        runs, in_use, kept = got[rank]
        assert runs > 0 and in_use == {"attention": "attn_ok", "gdn_conv": "conv_ok"} and kept == 1, (rank, got)


def test_an_installed_kernel_package_that_does_not_import_is_reported_off_with_its_error(tmp_path, monkeypatch):
    """A package present but broken (tilelang without z3-solver made flash-linear-attention's import fail on an
    H100: `OSError: libz3.so...`) was treated as absent: the loop ran its fallback without a word. It is now a
    candidate that fails the check with the import's error. The broken package here is a real one on disk whose
    import raises as a missing shared library does."""
    from raytune_ft.models import gated_delta as gd

    pkg = tmp_path / "causal_conv1d"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('raise OSError("libcausal_conv1d_cuda.so: cannot open shared object file")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    gd._causal_conv1d_fn.cache_clear()
    try:
        kernels = fp._conv_kernels()
        assert [k.name for k in kernels] == ["causal_conv1d"]
        lines: list[str] = []
        report = kc.check_kernels(ON_CPU, paths=[fp.conv_path(CFG, kernels)], log_line=lines.append)
        assert [(f.kernel, f.what) for f in report.failures] == [("causal_conv1d", "raised")]
        assert "causal_conv1d is installed but `import causal_conv1d` fails: OSError: libcausal_conv1d_cuda.so" \
            in report.failures[0].detail
        assert report.in_use == {"gdn_conv": "torch_segmented"} and "switched off" in lines[0]
    finally:
        monkeypatch.undo()
        gd._causal_conv1d_fn.cache_clear()
    assert fp._conv_kernels() == []              # absent (not installed here): nothing to report
