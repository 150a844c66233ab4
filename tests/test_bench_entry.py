"""bench/ as a user's benchmark kit: `python -m bench gpu ...` (its commands, a CPU smoke run that writes a
dated record, the figures it reads from a run's MLflow store), the wheelhouse install, and the kit's docs."""
from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from bench import gpu_kit
from bench.__main__ import main as bench_main
from tests.train.test_save_final import assert_trained_without_a_checkpoint

REPO = Path(__file__).resolve().parents[1]


def dry_run(capsys, *args) -> list[str]:
    assert bench_main(["gpu", *args, "--dry-run"]) == 0
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("=== ")]


@pytest.mark.parametrize("bench", ["suite", "speed", "fp8", "parity", "kernel-check", "startup", "imports", "eval",
                                   "recovery"])
def test_every_subcommand_prints_its_commands(capsys, bench):
    lines = dry_run(capsys, bench, "--gpus", "0")
    assert lines and all(f"=== {bench} / " in line and "(limit " in line for line in lines)


def test_fp8_on_one_gpu_is_the_8_layer_recipe_cut_through_ray_train_bf16_then_fp8(capsys):
    bf16, fp8 = dry_run(capsys, "fp8", "--gpus", "0")
    for line in (bf16, fp8):
        assert "jobs/qwen27b_b300.py" in line and "qwen3.8-27b-8layers" in line
        assert "scaling.num_workers=1" in line and "model.init=random" in line
        assert "master_weights" not in line          # the recipe's own fp32 master weights
    assert "train.precision=fp8" not in bf16
    assert "train.precision=fp8" in fp8 and "train.fp8_recipe=tensorwise" in fp8
    two = dry_run(capsys, "fp8", "--gpus", "0,1")
    assert all("qwen3.8-27b-16layers" in line and "scaling.num_workers=2" in line for line in two)


def test_speed_and_fp8_run_the_recipe_with_its_evaluation_samples_and_a_checkpoint(capsys):
    """Issue 36: the speed figure came from a run with samples and evaluation off, which users do not run."""
    for line in dry_run(capsys, "speed", "--gpus", "0") + dry_run(capsys, "fp8", "--gpus", "0"):
        assert "train.sample_prompts" not in line          # the recipe's own prompts and lengths
        assert "train.eval_every=4" in line and "train.checkpoint_every=4" in line
        assert "data.validation_fraction=0.05" in line
    (line,) = dry_run(capsys, "speed", "--gpus", "0", "--ckpt-every", "0")
    assert "train.eval_every=4" in line and "train.checkpoint_every=1000" in line


def test_recovery_wraps_the_recipe_run_in_the_killer(capsys, tmp_path):
    (line,) = dry_run(capsys, "recovery", "--gpus", "0", "--workdir", str(tmp_path))
    name = re.search(r"tracking.run_name=(\S+)", line).group(1)
    assert f"bench/recovery.py --run-dir {tmp_path / 'runs' / name} " in line and " -- " in line
    assert "train.checkpoint_every=2" in line and "scaling.max_failures=1" in line


def test_startup_runs_twice_on_one_storage_and_cache_with_fresh_run_names(capsys):
    cold, warm = dry_run(capsys, "startup", "--gpus", "0")
    cache = re.compile(r"train.cache_dir=(\S+)")
    storage = re.compile(r"tracking.storage_path=(\S+)")
    name = re.compile(r"tracking.run_name=(\S+)")
    # the last --set wins: the pair's own fresh folder, not the one the kit's other runs share
    assert cache.findall(cold)[-1] == cache.findall(warm)[-1] != cache.findall(cold)[0]
    assert storage.search(cold).group(1) == storage.search(warm).group(1)
    assert name.search(cold).group(1) != name.search(warm).group(1)
    # speed and start-up runs measure training alone
    assert "train.eval_every=0" in cold and "train.sample_prompts=0" in cold


def test_startup_cold_and_warm_one_at_a_time_share_a_cache_folder(capsys, tmp_path):
    work = str(tmp_path)
    (cold,) = dry_run(capsys, "startup", "--part", "cold", "--gpus", "0", "--workdir", work)
    (warm,) = dry_run(capsys, "startup", "--part", "warm", "--gpus", "0", "--workdir", work)
    cache = re.compile(r"train.cache_dir=(\S+)")
    assert cache.findall(cold)[-1] == cache.findall(warm)[-1] == os.path.join(work, "jit-cache-startup")
    with pytest.raises(SystemExit, match="cold, warm, storage, resubmit or all"):
        bench_main(["gpu", "startup", "--part", "kernels", "--dry-run", "--gpus", "0"])
    with pytest.raises(SystemExit, match="kernels, ray or all"):
        bench_main(["gpu", "suite", "--part", "warm", "--dry-run", "--gpus", "0"])


def test_startup_from_the_storage_is_a_fresh_node_with_the_cold_runs_storage(capsys, tmp_path, monkeypatch):
    """`--part storage` after `--part cold`: the same run storage (its jit_cache/ set) and cache folder path,
    and before the run every local cache of the machine is removed, the storage's sets left."""
    work = str(tmp_path / "work")
    (cold,) = dry_run(capsys, "startup", "--part", "cold", "--gpus", "0", "--workdir", work)
    (fresh,) = dry_run(capsys, "startup", "--part", "storage", "--gpus", "0", "--workdir", work)
    for pattern in (r"train.cache_dir=(\S+)", r"tracking.storage_path=(\S+)"):
        assert re.findall(pattern, cold)[-1] == re.findall(pattern, fresh)[-1]

    home, tmp = tmp_path / "home", tmp_path / "tmp"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setattr("tempfile.tempdir", str(tmp))
    import getpass
    kept = tmp_path / "work" / "runs" / "jit_cache"
    made = [home / ".triton" / "cache", home / ".nv" / "ComputeCache", home / ".cache" / "raytune_ft" / "jit" / "x",
            tmp / f"torchinductor_{getpass.getuser()}", kept]
    for d in made:
        d.mkdir(parents=True)
        (d / "f.bin").write_bytes(b"1" * 2**20)
    gone = gpu_kit.clear_local_caches()
    assert sorted(gone) == sorted(str(p) for p in [home / ".triton", home / ".nv" / "ComputeCache",
                                                   home / ".cache" / "raytune_ft" / "jit", made[3]])
    assert not any(os.path.exists(d) for d in gone)
    assert (kept / "f.bin").is_file()
    (kept / "node.tar").write_bytes(b"2" * 2**21)
    (kept / "bytecode").mkdir()
    (kept / "bytecode" / "py.tar").write_bytes(b"3" * 2**20)
    assert gpu_kit.stored_cache_sets(str(tmp_path / "work" / "runs")) == {"node.tar": 2.0, "py.tar": 1.0}


def test_a_setting_of_the_command_line_reaches_every_recipe_run_last(capsys):
    lines = dry_run(capsys, "fp8", "--gpus", "0", "--layers", "16", "--set", "train.master_weights=bf16")
    assert len(lines) == 2
    for line in lines:
        assert "qwen3.8-27b-16layers" in line
        assert line.split(" (limit ")[0].rstrip().endswith("--set train.master_weights=bf16")


def test_eval_sets_eval_every_sample_prompts_and_validation_data(capsys):
    (line,) = dry_run(capsys, "eval", "--gpus", "0")
    # eval compiles nothing the kit's earlier runs compiled: their cache folder, not the default one
    bf16, _ = dry_run(capsys, "fp8", "--gpus", "0")
    cache = re.compile(r"train.cache_dir=(\S+)")
    assert cache.findall(line) == cache.findall(bf16) and len(cache.findall(line)) == 1
    assert re.search(r"train.eval_every=[1-9]", line) and re.search(r"train.sample_prompts=[1-9]", line)
    assert "data.validation_split=none" in line and "data.validation_fraction=0.05" in line


def test_all_runs_every_measure(capsys):
    labels = {line.split(" / ")[0][4:] for line in dry_run(capsys, "all", "--gpus", "0")}
    assert labels == {"suite", "kernel-check", "fp8", "parity", "startup", "imports", "eval"}


@pytest.mark.timeout(300)
def test_cpu_smoke_of_the_suite_writes_a_dated_record(tmp_path):
    results = tmp_path / "results"
    proc = subprocess.run([sys.executable, "-m", "bench", "gpu", "suite", "--cpu-smoke", "--results", str(results),
                           "--workdir", str(tmp_path / "work")], cwd=REPO, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (day,) = results.glob("*.jsonl")
    rec = json.loads(day.read_text().splitlines()[-1])
    assert day.stem == rec["date"][:10]
    assert rec["bench"] == "suite" and "pytest -m gpu tests/gpu/" in rec["command"]
    assert rec["versions"]["torch"] != "absent" and "cpu_cores" in rec["hardware"]
    # on CPU every GPU test is skipped with its reason, none fails
    assert rec["figures"]["skipped"] > 0 and rec["figures"]["failed"] == 0
    assert any("no CUDA device" in r for r in rec["figures"]["skip_reasons"])
    assert "RESULT " in proc.stdout


@pytest.mark.timeout(300)
def test_cpu_smoke_of_the_imports_bench_times_the_workers_import_stages(tmp_path):
    """`imports --cpu-smoke`: the worker's import sequence in fresh processes, each stage timed, the slowest
    imports from Python's own trace, and whether the packages' bytecode is cached, in a dated record."""
    results = tmp_path / "results"
    proc = subprocess.run([sys.executable, "-m", "bench", "gpu", "imports", "--cpu-smoke", "--results", str(results),
                           "--workdir", str(tmp_path / "work")], cwd=REPO, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recs = [json.loads(line) for line in next(results.glob("*.jsonl")).read_text().splitlines()]
    # on CPU one plain process and two with a fresh bytecode folder (the GPU form: two and three)
    assert [r["label"] for r in recs] == ["imports-1", "imports-bytecode-1", "imports-bytecode-2"]
    # the last two as a job's processes start where the image writes no bytecode: into a folder of their own
    assert all(r["env"]["PYTHONPYCACHEPREFIX"].endswith("imports-bytecode") for r in recs[1:])
    assert recs[2]["figures"]["bytecode"]["pycache_prefix"] == recs[2]["env"]["PYTHONPYCACHEPREFIX"]
    assert list((tmp_path / "work" / "imports-bytecode").rglob("torch/__init__.*.pyc"))
    for rec in recs:
        fig = rec["figures"]
        stages = ["ray", "torch", "ray.train", "the loop's module", "tokenizer", "model code", "compile set-up"]
        assert [k for k in fig["stages"] if k not in ("total", "tokenizer_class")] == stages
        assert fig["stages"]["total"] == pytest.approx(sum(fig["stages"][k] for k in stages), abs=0.01)
        assert fig["stages"]["torch"] > 0 and len(fig["slowest"]) == 15
        assert any(name.startswith("torch") for name, _ in fig["slowest"])
        assert fig["bytecode"]["packages"]["torch"]["init_pyc"] in (True, False)


@pytest.mark.timeout(900)
def test_cpu_smoke_of_the_resubmit_bench_submits_twice_to_its_own_head_and_stops_it(tmp_path):
    """`startup --part resubmit --cpu-smoke`: a real Ray head (`ray start --head`, token authentication,
    dashboard and job server on loopback), two real `ray job submit`s of the local job; the records hold the
    run's breakdown from Ray's acceptance and the time from the submit command, and the head is gone after."""
    import psutil

    results, work = tmp_path / "results", tmp_path / "work"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    proc = subprocess.run([sys.executable, "-m", "bench", "gpu", "startup", "--part", "resubmit", "--cpu-smoke",
                           "--results", str(results), "--workdir", str(work)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=880)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    recs = [json.loads(line) for line in next(results.glob("*.jsonl")).read_text().splitlines()]
    assert [r["label"] for r in recs] == ["resubmit-1", "resubmit-2"]
    for rec in recs:
        fig = rec["figures"]
        assert "job submit" in rec["command"] and fig["submission_id"] in rec["command"]
        assert fig["startup"]["ray_workers.submission_s"] >= 0 and fig["startup"]["ray_workers.ray_start_s"] < 5
        assert 0 < fig["submit_command_s"] < 60
        assert fig["submit_to_first_step_s"] == pytest.approx(fig["submit_command_s"] + fig["startup"]["total_s"],
                                                             abs=0.01)
        # the bench's throughput runs save no final checkpoint: neither left one (tests/train/test_save_final.py)
        assert_trained_without_a_checkpoint(os.path.join(rec["settings"]["storage"], rec["settings"]["run_name"]),
                                            rec["settings"]["steps"], "train/lr")
    head = re.search(r"=== ray head: .* --temp-dir=(\S+)", proc.stdout).group(1)
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if any(head in a for a in (p.info["cmdline"] or []))]
    assert not left, left


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_cpu_smoke_of_speed_reports_the_steps_alone_and_end_to_end(tmp_path):
    """`speed --cpu-smoke`: the local recipe with its held-out loss, samples and a checkpoint half-way; the
    record holds the training steps' tokens/s and the end-to-end figure (evaluation, samples, checkpoint in)."""
    results = tmp_path / "results"
    proc = subprocess.run([sys.executable, "-m", "bench", "gpu", "speed", "--cpu-smoke", "--results", str(results),
                           "--workdir", str(tmp_path / "work")], cwd=REPO, capture_output=True, text=True, timeout=880)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    assert "samples at step 4" in proc.stdout and "eval at step 4" in proc.stdout
    assert "checkpoint at step 4" in proc.stdout
    (rec,) = [json.loads(line) for line in next(results.glob("*.jsonl")).read_text().splitlines()]
    fig = rec["figures"]
    assert fig["tok_s"] > 0 and 0 < fig["end_to_end_tok_s"] < fig["tok_s"]
    assert fig["end_to_end_not_steps_s"] > 0 and len(fig["eval_seconds"]) == 2
    assert rec["settings"]["eval_and_samples"] == "as shipped"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_cpu_smoke_of_recovery_times_the_kill_to_the_next_attempts_first_step(tmp_path):
    """`recovery --cpu-smoke`: a training worker SIGKILLed after the first checkpoint; the next attempt's first
    step is timed from the kill, and the dead worker is said in one line, not Ray's traceback."""
    results = tmp_path / "results"
    proc = subprocess.run([sys.executable, "-m", "bench", "gpu", "recovery", "--cpu-smoke", "--results", str(results),
                           "--workdir", str(tmp_path / "work")], cwd=REPO, capture_output=True, text=True, timeout=880)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    (rec,) = [json.loads(line) for line in next(results.glob("*.jsonl")).read_text().splitlines()]
    fig = rec["figures"]
    assert 0 < fig["kill_to_first_step_s"] < 600 and fig["killed"].startswith("pid ")
    # split where the new workers' processes started: noticing the death and rescheduling, then their own start
    assert fig["kill_to_new_workers_s"] >= 0 and fig["new_workers_own_start_s"] > 0
    assert "[raytune_ft] a training worker is gone (pid " in proc.stdout
    assert "ActorDiedError" not in proc.stdout and "Graceful shutdown of backend failed" not in proc.stdout
    # the next attempt's start-up line says its scheduling part holds the first attempt
    assert "earlier attempts, then attempt 2's trainer and worker scheduling" in proc.stdout


@pytest.mark.timeout(120)
def test_throughput_figures_leave_out_the_first_window(tmp_path):
    """A real MLflow sqlite store with the metrics a run logs (steps 2, 4, 6; the final report repeats 6)."""
    import mlflow

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    run = client.create_run(client.create_experiment("bench"))
    for step, tps, mem in ((2, 1000.0, 70.0), (4, 9000.0, 78.0), (6, 11000.0, 78.9), (6, 11000.0, 78.9)):
        for k, v in {"tokens_per_s": tps, "tokens_per_s_per_worker": tps / 2, "mfu": tps / 20000, "peak_mem_gib": mem,
                     "loss": 13.0}.items():
            client.log_metric(run.info.run_id, k, v, step=step)
    fig = gpu_kit.throughput_figures({"tracking_uri": uri, "mlflow_run_id": run.info.run_id, "steps": 6,
                                      "final_loss": 13.0})
    assert fig["tok_s_windows"] == [9000, 11000] and fig["tok_s"] == 10000 and fig["tok_s_per_gpu"] == 5000
    assert fig["mfu"] == 0.5 and fig["peak_gib"] == 78.9


def test_startup_resubmit_is_two_ray_job_submits_with_the_start_up_pairs_cache(capsys, tmp_path):
    work = str(tmp_path)
    first, second = dry_run(capsys, "startup", "--part", "resubmit", "--gpus", "0", "--workdir", work)
    for line in (first, second):
        assert "-m ray.scripts.scripts job submit --address http://127.0.0.1:" in line
        assert f"--working-dir {REPO}" in line and " -- " in line and "jobs/qwen27b_b300.py" in line
        assert "RAY_AUTH_MODE=token" in line
        assert re.findall(r"train.cache_dir=(\S+)", line)[-1] == os.path.join(work, "jit-cache-startup")
    ids = [re.search(r"--submission-id (\S+)", line).group(1) for line in (first, second)]
    assert ids[0] != ids[1] and all(i in line for i, line in zip(ids, (first, second)))


def test_startup_figures_cold_and_warm_side_by_side():
    cold = {"startup": {"ray_workers_s": 20.0, "kernel_check_s": 131.7, "total_s": 300.0}}
    warm = {"startup": {"ray_workers_s": 18.0, "kernel_check_s": 8.6, "total_s": 90.0}}
    side = gpu_kit.startup_side_by_side(cold, warm)
    assert side["kernel_check_s"] == {"cold": 131.7, "warm": 8.6}
    assert list(side) == ["ray_workers_s", "kernel_check_s", "total_s"]
    assert "note" in gpu_kit.startup_side_by_side({}, {})


def _wheel(folder: Path, name: str, package: str | None = None) -> Path:
    """A minimal pure-Python wheel, written as the wheel format lays it out (`package`: its folder, e.g.
    "ns/part" for a part of the namespace package "ns")."""
    path = folder / f"{name}-1.0-py3-none-any.whl"
    files = {f"{package or name}/__init__.py": "VALUE = 42\n",
             f"{name}-1.0.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
             f"{name}-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{k},,\n" for k in files) + f"{name}-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for k, v in files.items():
            z.writestr(k, v)
        z.writestr(f"{name}-1.0.dist-info/RECORD", record)
    return path


@pytest.mark.timeout(120)
def test_install_from_a_wheelhouse_installs_each_folder_and_ray(tmp_path):
    """Two wheel folders, one with a Ray tarball. The tarball is a stand-in (Ray's real one is 30 MB and needs
    PyPI): the two daemon files the script must make executable, and a package file."""
    one, two, site = tmp_path / "wh-1", tmp_path / "wh-2", tmp_path / "site"
    one.mkdir(), two.mkdir()
    _wheel(one, "benchpkg_one")
    _wheel(two, "benchpkg_two")
    daemons = ["ray/core/src/ray/raylet/raylet", "ray/core/src/ray/gcs/gcs_server"]
    src = tmp_path / "ray_src"
    for rel in [*daemons, "ray/__init__.py"]:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text("")
        (src / rel).chmod(0o644)
    with tarfile.open(two / "ray.tar.xz", "w:xz") as t:
        t.add(src / "ray", arcname="ray")
    proc = subprocess.run(["bash", "bench/install_wheelhouse.sh", "--target", str(site), str(one), str(two)],
                          cwd=REPO, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run([sys.executable, "-c", "import benchpkg_one, benchpkg_two, ray; print(benchpkg_two.VALUE)"],
                         env=env, capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert out.stdout.strip() == "42", out.stderr
    for rel in daemons:
        assert (site / rel).stat().st_mode & stat.S_IXUSR
    # Ray's job server starts only with a web build folder; the tarball leaves the pages out
    assert (site / "ray/dashboard/client/build/index.html").is_file()


@pytest.mark.timeout(120)
def test_a_namespace_package_split_over_two_wheelhouses_keeps_both_halves(tmp_path):
    """opentelemetry and google arrive in parts from two folders installed one at a time: the second
    install must not replace the first one's half of the shared top-level folder."""
    one, two, site = tmp_path / "wh-1", tmp_path / "wh-2", tmp_path / "site"
    one.mkdir(), two.mkdir()
    _wheel(one, "nsdemo_api", "nsdemo/api")
    _wheel(two, "nsdemo_exporter", "nsdemo/exporter")
    for folder in (one, two):
        proc = subprocess.run(["bash", "bench/install_wheelhouse.sh", "--target", str(site), str(folder)],
                              cwd=REPO, capture_output=True, text=True, timeout=100)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    out = subprocess.run([sys.executable, "-c", "import nsdemo.api, nsdemo.exporter; print(nsdemo.api.VALUE)"],
                         env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True, text=True, cwd=tmp_path,
                         timeout=60)
    assert out.stdout.strip() == "42", out.stderr
    assert not [p for p in site.iterdir() if p.name.startswith(".install")]


@pytest.mark.timeout(120)
def test_a_wheel_split_into_parts_installs_whole_and_a_cut_part_is_refused(tmp_path):
    """A built causal-conv1d wheel (~26 MB) comes back from a GPU node through a transfer that caps each file:
    bench/split_wheel.sh cuts it into parts with a checksum, install_wheelhouse.sh joins and checks them."""
    built, folder, site = tmp_path / "built", tmp_path / "wh-parts", tmp_path / "site"
    built.mkdir()
    wheel = _wheel(built, "benchpkg_split")
    with zipfile.ZipFile(wheel, "a") as z:      # big enough for several parts of 1 KiB
        z.writestr("benchpkg_split/data.bin", os.urandom(2500), compress_type=zipfile.ZIP_STORED)
    n = -(-wheel.stat().st_size // 1024)
    proc = subprocess.run(["bash", "bench/split_wheel.sh", str(wheel), str(folder), "1K"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    parts = sorted(folder.glob("*.whl.part-*"))
    assert len(parts) == n > 1 and all(p.stat().st_size <= 1024 for p in parts)
    assert not list(folder.glob("*.whl"))
    proc = subprocess.run(["bash", "bench/install_wheelhouse.sh", "--target", str(site), str(folder)],
                          cwd=REPO, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"joined: benchpkg_split-1.0-py3-none-any.whl from {n} parts" in proc.stdout
    out = subprocess.run([sys.executable, "-c", "import benchpkg_split; print(benchpkg_split.VALUE)"],
                         env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True, text=True, cwd=tmp_path,
                         timeout=60)
    assert out.stdout.strip() == "42", out.stderr
    parts[-1].write_bytes(parts[-1].read_bytes()[:-10])        # a part cut short in the transfer
    proc = subprocess.run(["bash", "bench/install_wheelhouse.sh", "--target", str(tmp_path / "site2"), str(folder)],
                          cwd=REPO, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 2 and "do not match" in proc.stderr, proc.stdout + proc.stderr


# ---------------------------------------------------------------- the kit's docs and files

WORDS = re.compile(r"carry|lent |session|device call", re.I)


def test_bench_and_readme_speak_only_of_the_project():
    paths = [REPO / "README.md", REPO / ".gitignore", *sorted((REPO / "bench").rglob("*"))]
    hits = []
    for p in paths:
        if not p.is_file() or p.suffix in (".png", ".pyc") or "results" in p.relative_to(REPO).parts:
            continue
        for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
            if WORDS.search(line):
                hits.append(f"{p.relative_to(REPO)}:{i}: {line.strip()[:120]}")
    assert not hits, "\n".join(hits)


def test_bench_readme_is_short_and_in_order():
    text = (REPO / "bench" / "README.md").read_text()
    assert len(text.splitlines()) < 120
    order = ["install_wheelhouse.sh", "python -m bench gpu suite", "python -m bench gpu speed",
             "python -m bench gpu fp8", "python -m bench gpu parity"]
    pos = [text.find(s) for s in order]
    assert -1 not in pos and pos == sorted(pos), dict(zip(order, pos))


def test_one_off_scripts_and_their_logs_are_gone():
    bench = REPO / "bench"
    assert not list(bench.glob("gpu_calls*.sh")) and not (bench / "gpu_lib.sh").exists()
    assert not list(bench.glob("gpu_results_*.jsonl"))
