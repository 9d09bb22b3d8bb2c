"""`python -m diffjax.eval` on a task whose dataset lives on the Hugging Face Hub, offline and not cached: one
line naming the task and its dataset, at once (no download retries), whether the user set HF_HUB_OFFLINE or the
Hub just does not answer."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from diffjax.convert.hub import OFFLINE_REASON

pytest.importorskip("lm_eval")

REPO_ROOT = Path(__file__).resolve().parents[1]
TASK = """task: hub_task
dataset_path: diffjax-tests/absent-dataset
test_split: test
output_type: loglikelihood
doc_to_text: "{{text}}"
doc_to_target: " x"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def byte_run_dir(tmp_path_factory):
    from diffjax.checkpoint import save_params
    from diffjax.config import ModelConfig
    from diffjax.model import TransformerLM

    config = ModelConfig(vocab_size=257, d_model=16, num_layers=1, num_heads=2, max_seq_len=32)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: TransformerLM(config, rngs=nnx.Rngs(0))))
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), nnx.to_pure_dict(state)))
    run_dir = tmp_path_factory.mktemp("eval-offline") / "run"
    save_params(run_dir, nnx.to_pure_dict(state), config)
    (run_dir / "config.yaml").write_text((run_dir / "config.yaml").read_text().replace(
        "data:\n", "data:\n  tokenizer: {kind: byte}\n"))
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("offline, who", [
    ({"HF_HUB_OFFLINE": "1"}, "offline mode is on (HF_HUB_OFFLINE set in your environment)"),
    ({"HF_ENDPOINT": "http://127.0.0.1:9"}, "diffjax switched to offline mode (set HF_HUB_OFFLINE) because the Hub "
                                            "(http://127.0.0.1:9) did not answer within 5 s")],
    ids=["HF_HUB_OFFLINE", "hub-does-not-answer"])
def test_a_dataset_out_of_reach_is_one_line_at_once(offline, who, byte_run_dir, tmp_path):
    """The line says who went offline: the user, or diffjax-eval because the Hub did not answer."""
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "hub_task.yaml").write_text(TASK)
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_ENDPOINT",
                                                            OFFLINE_REASON)}
    env.update(offline, HF_HOME=str(tmp_path / "hf-home"))  # an empty cache
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "diffjax.eval", "--model-path", str(byte_run_dir), "--tasks", "hub_task",
         "--include-path", str(tmp_path / "tasks"), "--no-builtin-tasks"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env=env)
    seconds = time.perf_counter() - start
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: task hub_task needs its dataset diffjax-tests/absent-dataset from the Hugging Face Hub, not in the "
        f"local cache (HF_HOME), and {who}: run once online to cache it, or evaluate a task on local files: "
        "--include-path DIR holding a task YAML with `dataset_path: json` and `dataset_kwargs: {data_files: {test: "
        "FILE.jsonl}}`"], result.stderr
    assert "Traceback" not in result.stderr and "Retrying" not in result.stderr, result.stderr
    assert seconds < 60, f"{seconds:.0f} s: a retry loop?"


@pytest.mark.parametrize("user_setting", [None, "HF_DATASETS_OFFLINE"])
def test_offline_messages_say_who_switched_offline(user_setting, monkeypatch):
    """diffjax-eval's own switch (the Hub did not answer) is told apart from the user's setting."""
    from diffjax.convert.hub import offline_because
    from diffjax.eval import hub_datasets

    for variable in (*hub_datasets.OFFLINE_VARIABLES, OFFLINE_REASON):  # absent now, and again after the test
        monkeypatch.setenv(variable, "")
        monkeypatch.delenv(variable)
    if user_setting:
        monkeypatch.setenv(user_setting, "1")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    hub_datasets.offline_unless_reachable()
    assert hub_datasets.is_offline()
    if user_setting:  # left as the user set it
        assert "HF_HUB_OFFLINE" not in os.environ
        assert offline_because(hub_datasets.OFFLINE_VARIABLES) == ("offline mode is on (HF_DATASETS_OFFLINE set in "
                                                                   "your environment)")
    else:
        assert offline_because() == ("diffjax switched to offline mode (set HF_HUB_OFFLINE) because the Hub "
                                     "(http://127.0.0.1:9) did not answer within 5 s")


def test_a_library_warning_prints_once():
    """absl gives the root logger a handler (at orbax's first log) and huggingface_hub has its own: its warnings
    (download retries) printed twice until the CLI stops them propagating."""
    script = ("import logging, absl.logging, datasets\n"
              "absl.logging.warning('absl configures the root logger here')\n"
              "from diffjax.eval import hub_datasets\n"
              "hub_datasets.quiet_duplicate_logs()\n"
              "logging.getLogger('huggingface_hub.utils._http').warning('a retry')\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert result.stderr.count("a retry") == 1, result.stderr
