"""train.wandb: Weights & Biases as a trainer hook (diffjax.train.wandb_log), tested in W&B's offline mode (no network,
no API key): the run files W&B writes are read back and must hold what metrics.jsonl holds, lambda per layer, the eval
loss and the config; a resumed run continues the same W&B run without logging a step twice. Off by default, and then
wandb is not imported."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from diffjax.run_dir import RunDir
from diffjax.train import load_run_config, train
from diffjax.train.config import RunConfig, build_config

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY = REPO_ROOT / "configs" / "tiny.yaml"
SMALL = [  # as tests/test_trainer.py's
    "model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.max_seq_len=64",
    "data.seq_len=32", "data.builtin_bytes=200000", "data.eval_batches=2", "data.eval_fraction=0.2",
    "data.shuffle_window_tokens=4096", "train.batch_size=4", "train.log_every=1", "train.eval_every=0",
    "train.sample_tokens=8", "train.progress=lines", "optim.warmup_steps=2", "parallel.data=1",
    "optim.decay_steps=8", "checkpoint.every=4",
]


def _wandb_records(path: Path) -> list:
    """The records of a .wandb file: W&B's framing of LevelDB's log format (a 7-byte ':W&B' header, then 32 KiB blocks
    of chunks with a 7-byte header: CRC, length, type FULL 1 / FIRST 2 / MIDDLE 3 / LAST 4), each record a
    wandb_internal_pb2.Record. W&B 0.31 has no Python reader of its own any more (its core is Go)."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", data[:7]
    position, pending, records = 7, b"", []
    while position + 7 <= len(data):
        left = block - position % block
        _crc, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if left < 7 or (length == 0 and kind == 0):  # a block's padding
            position += left
            continue
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _read_offline_run(sync_dir: Path) -> dict:
    """id, config, history {step: {key: value}} and summary of one offline-run-* directory."""
    (path,) = sync_dir.glob("run-*.wandb")
    run = {"history": {}, "summary": {}}
    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run["id"] = record.run.run_id
            run["config"] = {item.key: json.loads(item.value_json) for item in record.run.config.update}
        elif kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            assert record.history.step.num not in run["history"], f"step {record.history.step.num} logged twice"
            run["history"][record.history.step.num] = row
        elif kind == "summary":
            run["summary"].update({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                   for item in record.summary.update})
    return run


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in RunDir(run_dir).metrics_file.read_text().splitlines()]


def _assert_same_as_metrics_jsonl(run: dict, records: list[dict]):
    """Every metrics.jsonl record of run's steps is in the W&B history, value for value, as <kind>/<key>."""
    for record in records:
        row = run["history"][record["step"]]
        for key, value in record.items():
            if key not in ("step", "kind"):
                assert row[f"{record['kind']}/{key}"] == value, (record["step"], key, row)


@pytest.mark.slow
@pytest.mark.both_legs
def test_offline_run_logs_metrics_lambda_eval_and_config_and_a_resume_continues_it(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("WANDB_DIR", "WANDB_API_KEY", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(name, raising=False)
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    run_dir = tmp_path / "run"
    wandb_keys = ["train.wandb.project=diffjax-test", "train.wandb.tags=[ci, tiny]", "train.wandb.group=g"]

    # Steps 1-6 (checkpoints 4 and 6), then checkpoint 6 lost as if the trainer had died just before saving it: the
    # resumed run restarts from step 4 and repeats steps 5-6, which the W&B run already has.
    lines = []
    config = load_run_config(TINY, SMALL + [f"train.run_dir={run_dir}", "train.steps=6", *wandb_keys])
    train(config, log=lines.append)
    first_records = _metrics(run_dir)
    (first_dir,) = RunDir(run_dir).wandb.glob("offline-run-*")
    first = _read_offline_run(first_dir)
    assert any(line.startswith(f"W&B: run {first['id']} (new), offline") for line in lines), lines
    assert sorted(first["history"]) == [1, 2, 3, 4, 5, 6]
    assert {"train/lambda/layer_0", "train/lambda/layer_1"} <= set(first["history"][6])  # DIFF: lambda per layer
    _assert_same_as_metrics_jsonl(first, first_records)
    assert [r["kind"] for r in first_records].count("eval") == 1 and "eval/loss" in first["history"][6]
    expected_config = json.loads(json.dumps(config.to_dict()))
    assert {key: first["config"][key] for key in expected_config} == expected_config
    assert first["config"]["train"]["wandb"]["tags"] == ["ci", "tiny"]
    assert first["summary"]["sample"].startswith(config.train.sample_prompt)
    assert json.loads(RunDir(run_dir).wandb_run_file.read_text()) == {
        "id": first["id"], "project": "diffjax-test", "entity": None, "step": 6}

    shutil.rmtree(RunDir(run_dir).step_dir(6))
    lines = []
    config = load_run_config(TINY, SMALL + [f"train.run_dir={run_dir}", "train.steps=8", *wandb_keys])
    train(config, log=lines.append)
    assert any(line.startswith("resumed from") and "(step 4)" in line for line in lines), lines
    (second_dir,) = set(RunDir(run_dir).wandb.glob("offline-run-*")) - {first_dir}
    second = _read_offline_run(second_dir)
    assert second["id"] == first["id"]  # the same W&B run
    assert sorted(second["history"]) == [7, 8]  # 5 and 6 are not logged twice; W&B keeps the first run's
    records = _metrics(run_dir)
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, 9))
    _assert_same_as_metrics_jsonl(second, [r for r in records if r["step"] > 6])
    assert {r["step"]: r["loss"] for r in records if r["kind"] == "train" and r["step"] <= 6} == {
        r["step"]: r["loss"] for r in first_records if r["kind"] == "train"}  # the repeat reproduces what W&B has
    assert second["config"]["train"]["steps"] == 8 and "eval/loss" in second["history"][8]
    assert json.loads(RunDir(run_dir).wandb_run_file.read_text())["step"] == 8
    assert any(line.startswith(f"W&B: run {first['id']} (continuing after step 6)") for line in lines), lines


def test_missing_extra_is_one_line_before_set_up(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: import wandb and find_spec see nothing
    config = load_run_config(TINY, SMALL + [f"train.run_dir={tmp_path / 'run'}", "train.wandb.project=p"])
    with pytest.raises(ValueError, match=r'Weights & Biases \(wandb\) is not installed: pip install "diffjax\[wandb\]"') as raised:
        train(config, log=lambda _: None)
    assert raised.value.during_setup and not (tmp_path / "run").exists()  # train.py: "error: ..." and exit 2


@pytest.mark.parametrize("overrides, message", [
    (["train.wandb.projekt=p"], r"unknown config key train\.wandb\.projekt \(did you mean train\.wandb\.project\?\); "
                                r"valid keys under train\.wandb: entity, group, mode, name, project, tags"),
    (["train.wandb.project=p", "train.wandb.mode=onlin"],
     r"train\.wandb\.mode must be one of \('online', 'offline', 'disabled'\) or null"),
    (["train.wandb.mode=offline"], r"train\.wandb\.mode is set but train\.wandb\.project is not"),
    (["train.wandb.project="], r"train\.wandb\.project must be a non-empty string or null"),
])
def test_config_errors_name_the_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_run_config(TINY, overrides)


def test_config_default_off_and_round_trip():
    assert not load_run_config(TINY).train.wandb.enabled
    assert not load_run_config(TINY, ["train.wandb.project=p", "train.wandb.mode=disabled"]).train.wandb.enabled
    config = load_run_config(TINY, ["train.wandb.project=p", "train.wandb.tags=[a, b]", "train.wandb.mode=offline"])
    assert config.train.wandb.enabled and config.train.wandb.tags == ("a", "b")
    assert build_config(RunConfig, config.to_dict()) == config  # as config.yaml is read back


def test_the_trainer_does_not_import_wandb_by_default():
    code = ("import sys; import diffjax.train, diffjax.train.loop, diffjax.train.wandb_log; "
            f"from diffjax.train import load_run_config; assert not load_run_config({str(TINY)!r}).train.wandb.enabled; "
            "loaded = [m for m in sys.modules if m.split('.')[0] == 'wandb']; assert not loaded, loaded")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT, env={"JAX_PLATFORMS": "cpu", "PATH": ""})
