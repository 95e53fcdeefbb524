"""Sweeps at scale: launchers, resume after SIGKILL, failing cells, wandb offline, presets.

Everything runs the tiny random Llama on CPU. The subprocess tests run the real ``kvbench-run -m``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import CONFIG_DIR, REPO
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from kvbench.config import validate
from kvbench.results.writer import read_rows
from kvbench.runner import example, model_cache
from kvbench.runner.cell import run_cell

pytest_plugins = ["sweeping"]  # the sweep_in_process fixture

# configs/hydra/launcher/*.yaml share their names with the plugins' schemas (see kvbench/run.py).
pytestmark = pytest.mark.filterwarnings(r"ignore:(?s).*is validated against ConfigStore schema")

TINY = ["model=tiny-llama", "model.device=cpu", "task.n=2", "task.context_tokens=96", "task.max_new_tokens=3"]
# Their cells' directories: what TINY changes of the model's and the task's defaults follows each name.
CELLS = "tiny-llama/device=cpu/retrieval/n=2,context_tokens=96,max_new_tokens=3"


def kvbench_run(*args: str, timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvbench.run", *args], capture_output=True, text=True, cwd=REPO, timeout=timeout, env=env
    )


def cells(sweep_dir: Path) -> dict[str, Path]:
    """Cell path (below the sweep) -> directory, for every cell that has rows or an error."""
    found = {p.parent for p in sweep_dir.rglob("rows.jsonl")} | {p.parent for p in sweep_dir.rglob("error.txt")}
    return {str(p.relative_to(sweep_dir)): p for p in sorted(found)}


def strict_rows(path: Path) -> list[dict]:
    """Every line of a rows.jsonl, each of which must parse, ending with a newline."""
    text = path.read_text()
    assert text.endswith("\n"), f"{path} has a torn last line"
    return [json.loads(line) for line in text.splitlines()]


# ---------------------------------------------------------------- launchers


def test_sweeps_through_joblib_and_submitit_run_every_cell_and_survive_bad_ones(tmp_path):
    """A 2 x 2 grid of good cells plus a budget no policy accepts, through each launcher (both at once, to
    share the waiting): the four good cells write their rows in other processes, the two bad ones leave
    an error.txt, and the sweep lists them and exits 1."""
    procs = {}
    for launcher in ("joblib", "submitit_local"):
        cmd = [
            sys.executable,
            "-m",
            "kvbench.run",
            "-m",
            *TINY,
            "policy=window,streamingllm",
            "budget=0.25,0.5,1.5",
            f"hydra/launcher={launcher}",
            f"results_dir={tmp_path}",
            f"sweep_name={launcher}",
        ]
        procs[launcher] = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    outputs = {launcher: proc.communicate(timeout=300) for launcher, proc in procs.items()}
    for launcher, (stdout, stderr) in outputs.items():
        sweep = tmp_path / launcher
        found = cells(sweep)
        good = [c for c in found if not c.endswith("budget=1.5")]
        assert sorted(good) == [
            f"{CELLS}/{p}/prefill/budget={b}" for p in ("streamingllm", "window") for b in ("0.25", "0.5")
        ], stderr[-3000:]
        for name in good:
            rows = strict_rows(found[name] / "rows.jsonl")
            assert [r["example_id"] for r in rows] == ["passkey-0", "passkey-1"]
            assert all(r["status"] == "ok" for r in rows)
            assert (found[name] / "summary.json").exists() and not (found[name] / "error.txt").exists()
        for policy in ("window", "streamingllm"):
            bad = sweep / f"{CELLS}/{policy}/prefill/budget=1.5"
            assert "kvbench: budget=1.5 is out of range" in (bad / "error.txt").read_text()
            assert not (bad / "rows.jsonl").exists()
        assert procs[launcher].returncode == 1, stderr[-3000:]
        assert "2 cell(s) could not run" in stderr
        table = stdout[stdout.index("policy  budget") :].splitlines()
        assert len([line for line in table if "retrieval" in line]) == 4
    assert "Joblib.Parallel(n_jobs=2," in "".join(outputs["joblib"])
    assert list((tmp_path / "submitit_local/.submitit").rglob("*_result.pkl")), "submitit ran no job"


# ---------------------------------------------------------------- crash and resume


def test_sigkill_mid_cell_then_rerun_matches_an_uninterrupted_sweep(tmp_path, sweep_in_process):
    grid = [
        "model=tiny-llama",
        "model.device=cpu",
        "task.n=4",
        "task.context_tokens=160",
        "task.max_new_tokens=12",
        "policy=window,random",
        "budget=0.5",
    ]
    # The uninterrupted sweep runs here; the killed one and its rerun in processes of their own.
    code, _, err = sweep_in_process(*grid, sweep_name="reference")
    assert code == 0, err[-3000:]

    sweep = tmp_path / "killed"
    log = (tmp_path / "killed.log").open("w")
    cmd = [sys.executable, "-m", "kvbench.run", "-m", *grid, f"results_dir={tmp_path}", "sweep_name=killed"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            counts = {p: p.read_bytes().count(b"\n") for p in sweep.rglob("rows.jsonl")} if sweep.exists() else {}
            if any(n >= 1 for n in counts.values()):
                break
            assert proc.poll() is None, "the sweep ended before it could be killed"
            assert time.monotonic() < deadline, "no row appeared"
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    assert proc.returncode == -signal.SIGKILL
    interrupted = [p for p in sweep.rglob("rows.jsonl") if not (p.parent / "summary.json").exists()]
    assert len(list(sweep.rglob("summary.json"))) < 2, "the sweep was done before the kill"
    assert interrupted and all(0 < len(read_rows(p)) < 4 for p in interrupted), "not killed in the middle of a cell"
    # As if the kill had landed in the middle of a write: half a row with no newline.
    with interrupted[0].open("a") as f:
        f.write('{"example_id": "passkey-3", "status": "o')

    rerun = kvbench_run("-m", *grid, f"results_dir={tmp_path}", "sweep_name=killed")
    assert rerun.returncode == 0, rerun.stderr[-3000:]

    def collect(root: Path) -> dict[tuple[str, str], dict]:
        out = {}
        for path in root.rglob("rows.jsonl"):
            for row in strict_rows(path):
                key = (str(path.parent.relative_to(root)), row["example_id"])
                assert key not in out, f"duplicate row {key}"
                out[key] = row
        return out

    resumed, expected = collect(sweep), collect(tmp_path / "reference")
    assert set(resumed) == set(expected) and len(expected) == 8
    for key, row in expected.items():
        assert resumed[key]["status"] == row["status"] == "ok"
        assert resumed[key]["prediction"] == row["prediction"], key  # greedy: the same tokens
        assert resumed[key]["kept_tokens"] == row["kept_tokens"]
    for summary in sweep.rglob("summary.json"):
        assert json.loads(summary.read_text())["n_ok"] == 4


# ---------------------------------------------------------------- one process, many cells


def test_one_process_loads_the_model_once_and_failing_examples_become_rows(tmp_path, monkeypatch, sweep_in_process):
    loads, calls = [], []
    real_load, real_example = model_cache.load_model, example.generation_outcome
    monkeypatch.setattr(model_cache, "_MODELS", {})
    monkeypatch.setattr(model_cache, "load_model", lambda *a, **k: loads.append(a) or real_load(*a, **k))

    def flaky(lm, task, spec, ex, prompt, *args, **kwargs):
        calls.append((spec.policy.name, spec.budget, ex.id))
        if spec.policy.name == "window" and spec.budget == 0.25 and ex.id == "passkey-1":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        if spec.policy.name == "random" and ex.id == "passkey-0":
            raise RuntimeError("synthetic failure")
        return real_example(lm, task, spec, ex, prompt, *args, **kwargs)

    monkeypatch.setattr(example, "generation_outcome", flaky)
    code, out, _ = sweep_in_process(*TINY, "policy=full,window,random", "budget=0.25,0.5")
    assert code == 0
    assert len(loads) == 1, "the model must load once per process"
    sweep = tmp_path / "p"
    assert sorted(cells(sweep)) == [
        f"{CELLS}/{p}/prefill/budget={b}"
        for p, b in [("full", "full"), ("random", "0.25"), ("random", "0.5"), ("window", "0.25"), ("window", "0.5")]
    ]
    # The full cache ignores the budget: its two sweep points share one cell, run once.
    assert [c for c in calls if c[0] == "full"] == [("full", 0.25, "passkey-0"), ("full", 0.25, "passkey-1")]
    oom = read_rows(sweep / f"{CELLS}/window/prefill/budget=0.25/rows.jsonl")
    assert [r["status"] for r in oom] == ["ok", "error"]
    assert oom[1]["error"].startswith("OutOfMemoryError: CUDA out of memory")
    for budget in ("0.25", "0.5"):
        rows = read_rows(sweep / f"{CELLS}/random/prefill/budget={budget}/rows.jsonl")
        assert [r["status"] for r in rows] == ["error", "ok"] and "synthetic failure" in rows[0]["error"]
        summary = json.loads((sweep / f"{CELLS}/random/prefill/budget={budget}/summary.json").read_text())
        assert summary["n_ok"] == 1 and summary["n_error"] == 1
    assert "random" in out and "window" in out  # the table

    # A rerun skips every finished cell and example.
    calls.clear()
    code, _, _ = sweep_in_process(*TINY, "policy=full,window,random", "budget=0.25,0.5")
    assert code == 0 and calls == []

    # A changed setting is a cell of its own: it runs beside the others and leaves their rows alone.
    before = {name: (path / "rows.jsonl").read_text() for name, path in cells(sweep).items()}
    code, _, _ = sweep_in_process(*TINY, "task.n=3", "policy=window", "budget=0.5")
    more = "tiny-llama/device=cpu/retrieval/n=3,context_tokens=96,max_new_tokens=3/window/prefill/budget=0.5"
    assert code == 0 and [c[2] for c in calls] == ["passkey-0", "passkey-1", "passkey-2"]
    assert json.loads((sweep / more / "summary.json").read_text())["n_ok"] == 3
    assert before == {name: (path / "rows.jsonl").read_text() for name, path in cells(sweep).items() if name != more}

    # The same cell made with other settings (as if the task's default seed had changed since) is refused, cell
    # by cell, and its rows stay as they were.
    calls.clear()
    config = sweep / f"{CELLS}/window/prefill/budget=0.5/config.yaml"
    recorded = yaml.safe_load(config.read_text())
    recorded["task"]["seed"] = 1
    config.write_text(yaml.safe_dump(recorded, sort_keys=False))
    code, _, err = sweep_in_process(*TINY, "policy=window", "budget=0.5")
    assert code == 1 and calls == []
    message = (sweep / f"{CELLS}/window/prefill/budget=0.5/error.txt").read_text()
    assert "holds results of a different config (task.seed: 1 -> 0)" in message
    assert "1 cell(s) could not run" in err
    assert before == {name: (path / "rows.jsonl").read_text() for name, path in cells(sweep).items() if name != more}


def test_a_cell_another_process_is_writing_is_left_to_it(tmp_path, monkeypatch):
    """In a sweep, the budgets of policy=full share one cell: a second process reaching it while the first
    writes it skips it; run alone, the same clash is an error."""
    from kvbench.results.writer import CellBusy, CellResults

    monkeypatch.setattr(model_cache, "get_model", lambda *_: pytest.fail("a busy cell loaded the model"))
    config = composed(*TINY, "policy=full")
    cell = tmp_path / "cell"
    with CellResults(cell):
        assert run_cell(config, cell, "t", skip_busy=True)["skipped"] == "busy"
        with pytest.raises(CellBusy, match="being written by another process"):
            run_cell(config, cell, "t")
    assert not (cell / "rows.jsonl").exists() and not (cell / "error.txt").exists()


# ---------------------------------------------------------------- wandb


def wandb_records(path: Path):
    """The records of a ``.wandb`` file (LevelDB-style log: 32 KiB blocks, 7-byte record headers)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            yield record


def key(item) -> str:
    """A history or summary item's name (wandb stores some as ``nested_key``)."""
    return item.key or "/".join(item.nested_key)


def test_wandb_offline_writes_config_table_and_summary(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(
        WANDB_CACHE_DIR=str(tmp_path / "wb-cache"),
        WANDB_DATA_DIR=str(tmp_path / "wb-data"),
        WANDB_CONFIG_DIR=str(tmp_path / "wb-config"),
        HF_HUB_OFFLINE="1",
    )
    out = kvbench_run(
        "-m",
        *TINY,
        "policy=window,random",
        "tracking.wandb.mode=offline",
        "tracking.wandb.project=kvb-test",
        f"results_dir={tmp_path}",
        "sweep_name=wb",
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert not [line for line in (out.stdout + out.stderr).splitlines() if line.startswith("wandb:")]
    for policy in ("window", "random"):
        cell = tmp_path / f"wb/{CELLS}/{policy}/prefill/budget=0.5"
        (run_dir,) = (cell / "wandb").glob("offline-run-*")
        (log_file,) = run_dir.glob("run-*.wandb")
        records = list(wandb_records(log_file))
        (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
        assert run.project == "kvb-test" and run.run_group == "wb" and run.job_type == "cell"
        config = {item.key: json.loads(item.value_json) for item in run.config.update}
        assert config["policy"]["name"] == policy and config["budget"] == 0.5 and config["task"]["n"] == 2
        summary = {
            key(item): json.loads(item.value_json)
            for r in records
            if r.WhichOneof("record_type") == "summary"
            for item in r.summary.update
        }
        assert summary["n_ok"] == 2 and summary["policy"] == policy and "mean.score" in summary
        history = [
            {key(item): json.loads(item.value_json) for item in r.history.item}
            for r in records
            if r.WhichOneof("record_type") == "history"
        ]
        assert sum("budget_achieved" in h for h in history) == 2  # one step per example
        assert any(r.WhichOneof("record_type") == "exit" and r.exit.exit_code == 0 for r in records)
        (table_file,) = (run_dir / "files/media/table").glob("examples_*.table.json")
        table = json.loads(table_file.read_text())
        ids = table["columns"].index("example_id")
        assert [row[ids] for row in table["data"]] == ["passkey-0", "passkey-1"]
        assert "prediction" in table["columns"]


# ---------------------------------------------------------------- presets


def composed(*overrides: str, hydra: bool = False):
    if GlobalHydra.instance().is_initialized():  # inside a test's own initialize_config_dir
        return compose("config", overrides=list(overrides), return_hydra_config=hydra)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=hydra)


def options(group: str) -> set[str]:
    return {p.stem for p in (CONFIG_DIR / group).glob("*.yaml")}


# roco_paper_prefill and roco_paper_decode sweep subsets of roco_paper's cells (see test_preset_grids).
PRESETS = ["smoke", "main", "roco_paper", "longbench"]


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_cells_compose_and_validate(preset):
    """Every value a preset sweeps composes and validates (no model, no data read). Options that other
    work has not added yet (policies, the instructions task) are reported as a skip."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        checked, missing = _check_preset(preset)
    assert checked
    if missing:
        pytest.skip(f"{preset}: not in configs/ yet: {', '.join(missing)}")


def _check_preset(preset: str) -> tuple[int, list[str]]:
    params = dict(composed(f"experiment={preset}", hydra=True).hydra.sweeper.params)
    swept = {key: str(value).split(",") for key, value in params.items()}
    missing = sorted(
        {
            f"{key}={v}"
            for key, values in swept.items()
            if key in ("policy", "task", "model")
            for v in values
            if v not in options(key)
        }
    )
    checked = 0
    for key, values in swept.items():
        # Every option of a config group; the first and last of a plain value (budgets differ only in number).
        for value in values if key in ("policy", "task", "model", "task.subset") else {values[0], values[-1]}:
            if f"{key}={value}" in missing:
                continue
            cell = {
                k: (value if k == key else next((x for x in v if f"{k}={x}" not in missing), v[0]))
                for k, v in swept.items()
            }
            if any(f"{k}={v}" in missing for k, v in cell.items()):
                continue
            config = composed(f"experiment={preset}", *(f"{k}={v}" for k, v in cell.items()))
            spec = validate(config)
            if preset.startswith("roco_paper"):
                assert (
                    spec.stage
                    == {"xsum": "prefill", "cnn_dailymail": "prefill", "instructions": "decode"}[spec.task_cfg["name"]]
                )
            checked += 1
    return checked, missing


def test_preset_grids():
    smoke = composed("experiment=smoke", hydra=True)
    assert smoke.model.name == "tiny-llama" and smoke.hydra.mode.name == "MULTIRUN"
    roco = composed("experiment=roco_paper", hydra=True).hydra.sweeper.params
    assert roco.budget == "0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9"
    assert set(roco.policy.split(",")) == {
        "random",
        "streamingllm",
        "h2o",
        "scissorhands",
        "tova",
        "roco",
        "full",
        "mean_window",
        "accumulated_robust",
    }
    assert composed("experiment=roco_paper_prefill", hydra=True).hydra.sweeper.params.task == "xsum,cnn_dailymail"
    assert composed("experiment=roco_paper_decode", hydra=True).hydra.sweeper.params.task == "instructions"
    assert composed("experiment=roco_paper", "task=cnn_dailymail").stage == "prefill"
    assert composed("experiment=roco_paper", "task=xsum", "stage=both").stage == "both"  # the command line wins
    longbench = composed("experiment=longbench", hydra=True).hydra.sweeper.params
    assert longbench["task.subset"].split(",") == [
        "narrativeqa",
        "qasper",
        "multifieldqa_en",
        "hotpotqa",
        "2wikimqa",
        "musique",
        "gov_report",
        "qmsum",
        "multi_news",
        "trec",
        "triviaqa",
        "samsum",
        "passage_count",
        "passage_retrieval_en",
        "lcc",
        "repobench-p",
    ]
    ruler = composed("experiment=ruler", hydra=True)
    assert ruler.task.name == "ruler" and ruler.model.name == "smollm2-135m" and not ruler.task.question_aware
    params = ruler.hydra.sweeper.params
    assert params["task.context_tokens"] == "1024,2048,4096,8192"
    assert len(set(params["task.subset"].split(","))) == 13  # every RULER subtask
    niah = composed("experiment=niah", hydra=True)
    assert niah.task.name == "niah" and niah.model.name == "smollm2-135m" and not niah.task.question_aware
    params = niah.hydra.sweeper.params
    assert len(params["task.context_tokens"].split(",")) == 5
    assert params["task.depth"] == "0,10,20,30,40,50,60,70,80,90,100"


def test_launcher_presets(tmp_path, monkeypatch):
    joblib = composed("hydra/launcher=joblib", hydra=True).hydra.launcher
    assert joblib.n_jobs == 2 and joblib._target_.endswith("JoblibLauncher")
    local = composed("hydra/launcher=submitit_local", hydra=True).hydra.launcher
    assert local._target_.endswith("LocalLauncher")
    slurm = composed(
        "hydra/launcher=submitit_slurm",
        "hydra.launcher.partition=gpu",
        "hydra.launcher.timeout_min=30",
        "hydra.launcher.mem_gb=32",
        hydra=True,
    ).hydra.launcher
    assert slurm.gpus_per_node == 1 and slurm.tasks_per_node == 1
    assert (slurm.partition, slurm.timeout_min, slurm.mem_gb) == ("gpu", 30, 32)

    # The sbatch script submitit would write for one cell (a fake srun stands in for the cluster).
    import submitit
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    params = OmegaConf.to_container(slurm, resolve=False)
    for key in ("_target_", "submitit_folder", "name"):
        params.pop(key)
    executor = submitit.AutoExecutor(
        cluster="slurm", folder=tmp_path / "%j", slurm_max_num_timeout=params.pop("max_num_timeout")
    )
    shared = set(OmegaConf.structured(BaseQueueConf).keys())
    executor.update_parameters(name="run", **{k if k in shared else f"slurm_{k}": v for k, v in params.items()})
    script = executor._executor._make_submission_file_text("python -m kvbench.run", "uid")
    for line in (
        "#SBATCH --gpus-per-node=1",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=30",
        "#SBATCH --mem=32GB",
    ):
        assert line in script
