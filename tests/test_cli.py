"""The `raytune-ft` command line: subcommands, help, exit codes, the runs table."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from raytune_ft import cli
REPO = Path(__file__).resolve().parents[1]


def test_no_command_prints_help(capsys):
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    for cmd in ("run", "plan", "register", "runs"):
        assert cmd in out
    assert "examples:" in out


def test_help_of_each_subcommand(capsys):
    for cmd, expect in (("run", "--dry-run"), ("plan", "--gpu"), ("runs", "--storage")):
        with pytest.raises(SystemExit) as e:
            cli.main([cmd, "--help"])
        assert e.value.code == 0
        assert expect in capsys.readouterr().out


def test_register_help_is_the_registry_own(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["register", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "raytune-ft register" in out and "--name" in out


def test_help_names_checkpoint_folders_as_ray_writes_them(capsys):
    """Ray Train names checkpoint folders checkpoint_<timestamp>, never checkpoint_000001."""
    assert cli.main([]) == 0
    with pytest.raises(SystemExit):
        cli.main(["register", "--help"])
    out = capsys.readouterr().out
    assert "checkpoint_000001" not in out
    assert "checkpoint_<timestamp>" in out


def test_register_rejects_a_bad_name(tmp_path, capsys):
    assert cli.main(["register", str(tmp_path), "--name", "not-three-levels",
                     "--tracking-uri", f"sqlite:///{tmp_path}/m.db"]) == 2
    assert "catalog.schema.model" in capsys.readouterr().err


def test_run_dry_run_local_applies_overrides_and_prints_plan(capsys):
    assert cli.main(["run", "qwen27b_b300", "--local", "--dry-run", "--set", "train.max_steps=3",
                     "--set=train.lr=0.01"]) == 0
    out = capsys.readouterr().out
    recipe = json.loads(out[: out.index("\nmemory plan:")])
    assert recipe["train"]["max_steps"] == 3 and recipe["train"]["lr"] == 0.01
    assert recipe["model"]["local_tiny"] is True
    assert "memory plan: qwen27b_b300" in out and "(tiny)" in out


def test_dry_run_and_recipe_errors_print_no_uri_password(capsys):
    uri = "https://bob:pw-7c1e9a2b@mlflow.example:5000"
    assert cli.main(["run", "qwen27b_b300", "--local", "--dry-run", f"--set=tracking.tracking_uri={uri}"]) == 0
    out = capsys.readouterr().out
    assert "pw-7c1e9a2b" not in out and "https://bob:***@mlflow.example:5000" in out
    assert cli.main(["run", "qwen27b_b300", "--dry-run", "--set=tracking.tracking_uri=ftp://bob:pw-7c1e9a2b@h/"]) == 2
    err = capsys.readouterr().err
    assert "tracking.tracking_uri" in err and "pw-7c1e9a2b" not in err


def test_run_bad_recipe_exits_2_naming_the_field(capsys):
    assert cli.main(["run", "qwen27b_b300", "--dry-run", "--set", "train.lr=-1"]) == 2
    assert "train.lr" in capsys.readouterr().err


def test_run_unknown_job_exits_2_listing_the_jobs(capsys):
    """An input error like the others (exit 2, not Python's 1 for an exit message), for run and plan."""
    for cmd in ("run", "plan"):
        with pytest.raises(SystemExit) as e:
            cli.main([cmd, "no_such_job"])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("error: no job 'no_such_job'") and "qwen27b_b300" in err


def test_a_mistyped_field_gets_the_near_name_without_the_list_of_fields(capsys):
    assert cli.main(["run", "qwen27b_b300", "--dry-run", "--set", "train.sample_prompt=1"]) == 2
    err = capsys.readouterr().err
    assert "(did you mean train.sample_prompts?)" in err and "fields:" not in err and "lora_alpha" not in err
    assert cli.main(["run", "qwen27b_b300", "--dry-run", "--set", "trian.lr=1"]) == 2
    err = capsys.readouterr().err
    assert "(did you mean train.lr?)" in err and "sections:" not in err
    # nothing near: the names there are
    assert cli.main(["run", "qwen27b_b300", "--dry-run", "--set", "train.zzzz=1"]) == 2
    assert "(fields: loop, lr, " in capsys.readouterr().err


def test_the_jobs_help_says_what_its_local_variant_uses(capsys):
    mod = cli._load_job("qwen27b_b300")
    with pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())       # argparse wraps the help
    assert "tiny model of the same family and generated chat data: no GPU, no model hub, no dataset hub" in out
    assert "(this job: tiny qwen3_5 model, generated chat data, 2 gloo workers)" in out
    assert "bundled data" not in out


@pytest.mark.parametrize("value, shown", [("0", 0), ("3", 3), ("prompts.jsonl", "prompts.jsonl")])
def test_sample_prompts_set_to_a_number_is_a_number_in_the_dry_run(capsys, value, shown):
    assert cli.main(["run", "qwen27b_b300", "--local", "--dry-run", f"--set=train.sample_prompts={value}"]) in (0, 2)
    out = capsys.readouterr().out
    if isinstance(shown, int):
        recipe = json.loads(out[: out.index("\nmemory plan:")])
        assert recipe["train"]["sample_prompts"] == shown and f'"sample_prompts": {shown},' in out
    else:       # a file name stays text (and is checked as a file: this one does not exist)
        from raytune_ft.recipe.recipe import Recipe, apply_overrides

        assert apply_overrides(Recipe(), [f"train.sample_prompts={value}"]).train.sample_prompts == shown


def test_each_register_call_keeps_the_libraries_lines_in_a_log_of_its_own(tmp_path, monkeypatch):
    """Not one register.log shared by every process of the machine: each call names its own file."""
    from raytune_ft.console import library_log

    monkeypatch.setenv("HOME", str(tmp_path))
    first, second = library_log("register", per_call=True), library_log("register", per_call=True)
    assert first != second and os.path.dirname(first) == str(tmp_path / ".cache" / "raytune_ft" / "logs")
    assert os.path.basename(first).startswith("register-") and f"-{os.getpid()}.log" in first
    assert first != library_log("register")


def test_plan_27b_fits_on_b300(capsys):
    assert cli.main(["plan", "qwen27b_b300"]) == 0
    out = capsys.readouterr().out
    assert "B300" in out and "FITS" in out and "time plan:" in out and "optimizer" in out


def test_plan_exit_code_1_when_it_does_not_fit(capsys):
    assert cli.main(["plan", "qwen27b_b300", "--set", "scaling.num_workers=1", "--gpu", "H100"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_plan_unknown_gpu_is_a_clear_error(capsys):
    assert cli.main(["plan", "qwen27b_b300", "--gpu", "TPUv9"]) == 2
    assert "unknown GPU 'TPUv9'" in capsys.readouterr().err


def _summary(storage: Path, name: str, **kw) -> Path:
    from raytune_ft.driver.run import RunSummary

    s = RunSummary(job=kw.pop("job", "qwen27b_b300"), run_name=name, status=kw.pop("status", "registered"), **kw)
    d = storage / name
    d.mkdir(parents=True)
    (d / "summary.json").write_text(json.dumps(asdict(s)))
    return d / "summary.json"


def test_runs_table_from_summaries_newest_first(tmp_path, capsys):
    old = _summary(tmp_path, "run-old", steps=20, final_loss=3.25, registered_name="main.default.m",
                   registered_version="1")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    _summary(tmp_path, "run-new", status="trained_not_registered", steps=7, final_loss=4.5,
             registration_error="timeout", retry_command="raytune-ft register ...")
    (tmp_path / "not-a-run").mkdir()
    assert cli.main(["runs", "--storage", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["FINISHED", "RUN", "JOB"]
    assert "run-new" in lines[1] and "run-old" in lines[2] and len(lines) == 3
    assert "trained_not_registered" in lines[1] and "4.5000" in lines[1] and "failed" in lines[1]
    assert "registered" in lines[2] and " 20 " in lines[2] and "3.2500" in lines[2]
    assert "main.default.m v1" in lines[2]


def test_runs_json_and_empty(tmp_path, capsys):
    _summary(tmp_path, "r1", steps=3, final_loss=1.0)
    assert cli.main(["runs", "--storage", str(tmp_path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["run_name"] for r in rows] == ["r1"] and rows[0]["steps"] == 3
    assert cli.main(["runs", "--storage", str(tmp_path / "nothing")]) == 0
    assert "no runs found" in capsys.readouterr().out


@pytest.mark.timeout(120)
def test_runs_json_into_a_pipe_closed_early_ends_quietly(tmp_path):
    """`raytune-ft runs --json | head`: the reader stops early; no BrokenPipeError traceback, exit 0."""
    for i in range(300):     # more than a pipe's buffer holds, so the writer meets the closed pipe
        _summary(tmp_path, f"run-{i:03d}", steps=i, final_loss=1.0)
    p = subprocess.Popen([sys.executable, "-m", "raytune_ft.cli", "runs", "--storage", str(tmp_path), "--json",
                          "--limit", "300"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout.readline().strip() == b"["
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=100) == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


@pytest.mark.timeout(120)
def test_runs_shows_an_unfinished_run_from_its_mlflow_store(tmp_path, capsys):
    """A run still training has no summary.json: its status and last loss come from MLflow."""
    import mlflow

    from raytune_ft.tracking import mlflow_run as tracking
    from raytune_ft.recipe.recipe import Recipe

    recipe = Recipe()
    recipe.tracking.storage_path = str(tmp_path)
    recipe.tracking.run_name = "in-flight"
    os.makedirs(recipe.run_dir)
    run_id = tracking.start_run(recipe)
    client = mlflow.MlflowClient(recipe.tracking_uri)
    for step, loss in ((100, 2.5), (200, 2.0)):
        client.log_metric(run_id, tracking.mlflow_metric_name("loss"), loss, step=step)   # as the loops name it
    assert cli.main(["runs", "--storage", str(tmp_path)]) == 0
    row = capsys.readouterr().out.splitlines()[1]
    assert "in-flight" in row and "running" in row and "200" in row and "2.0000" in row


@pytest.mark.timeout(120)
def test_job_script_still_runs_as_python_jobs_x():
    """`python jobs/X.py` keeps working (the in-process tests above cover `raytune-ft run`)."""
    p = subprocess.run([sys.executable, "jobs/qwen27b_b300.py", "--local", "--dry-run"], cwd=REPO,
                       capture_output=True, text=True, timeout=110)
    assert p.returncode == 0, p.stderr
    assert '"job": "qwen27b_b300"' in p.stdout and "memory plan:" in p.stdout


def test_summary_labels_its_two_rates_and_spaces_the_data_row():
    from raytune_ft.driver.run import RunSummary

    s = RunSummary(job="j", run_name="r", status="trained", steps=20, tokens=20_000, attempt_tokens=20_000,
                   tokens_per_s=650.0, steps_tokens_per_s=4400.0,
                   data={"rows_read": 512, "rows_trained": 500, "rows_held_out": 12, "conversations": 500, "blocks": 40})
    text = "\n".join(s.lines())
    assert "20,000 (650 tokens/s over the training loop, saves and evals included)" in text
    assert "training steps   4,400 tokens/s" in text
    assert "512 rows read: 500 trained (500 conversations), 12 held out, 0 skipped, 40 blocks" in text
    s.data["rows_skipped_by_reason"] = {"no_assistant": 2}
    assert "2 skipped {'no_assistant': 2}, 40 blocks" in "\n".join(s.lines())


def test_run_off_a_terminal_turns_off_ray_colours_and_progress_bars(monkeypatch, capsys):
    """Under `ray job submit` or a pipe the driver's stdout is a file: no ANSI colours, no tqdm bars."""
    import raytune_ft.driver.run as run_mod

    seen = {}

    def fake_run(recipe, *, local=False, register=None):
        seen["color"] = os.environ.get("RAY_COLOR_PREFIX")
        seen["bars"] = os.environ.get("RAY_DATA_DISABLE_PROGRESS_BARS")
        return run_mod.RunSummary(job=recipe.job, run_name=recipe.tracking.run_name, status="trained")

    from raytune_ft.console import PLAIN_ENV, QUIET_ENV

    for var in (*PLAIN_ENV, *QUIET_ENV):
        monkeypatch.setenv(var, "unset")     # so that monkeypatch restores the original afterwards
        monkeypatch.delenv(var)
    monkeypatch.setattr(run_mod, "run", fake_run)
    assert cli.main(["run", "qwen27b_b300", "--local", "--no-register"]) == 0   # capsys: not a terminal
    assert seen == {"color": "0", "bars": "1"}
    out = capsys.readouterr().out
    assert "job qwen27b_b300 (run qwen27b-local): trained" in out


def test_quiet_processes_hide_torchaos_compile_warnings_and_keep_others(tmp_path):
    """torchao's sources warn "invalid escape sequence" when first compiled (a SyntaxWarning on the GPU
    machine's Python 3.12, a DeprecationWarning on 3.11): a worker after the setup hook shows none of
    them, and still shows the same warning from any other package. A fresh process: the filters are
    the subject, and pytest's own warning capture must not decide."""
    for pkg in ("torchao", "otherpkg"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text('PATTERN = "\\d+"\n')
    code = ("from raytune_ft.console import quiet_process; quiet_process(); "
            "import torchao, otherpkg; print('imported')")
    proc = subprocess.run([sys.executable, "-W", "default", "-B", "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": f"{tmp_path}:{REPO}",
                                                       "HOME": str(tmp_path)})
    assert proc.returncode == 0 and "imported" in proc.stdout, proc.stderr
    # any other package's warning is kept, in the workers' log file rather than on the console (issue 37)
    log = (tmp_path / ".cache" / "raytune_ft" / "logs" / "workers.log").read_text()
    assert "otherpkg" in log and "invalid escape sequence" in log, log
    assert "torchao" not in proc.stderr + log and "otherpkg" not in proc.stderr, proc.stderr
    from raytune_ft.console import QUIET_ENV
    assert QUIET_ENV["TORCH_CPP_LOG_LEVEL"] == "ERROR"     # c10d's C++ warnings in the workers
