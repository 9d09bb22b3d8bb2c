"""data.source "hf" (diffjax.data.hf_datasets): a dataset by its Hugging Face Hub name, read offline from the
Hugging Face cache written here by hand in huggingface_hub's layout (tests/hub_cache.py; the network is closed), gives
the pipeline exactly the batches the same documents give as a jsonl file, by index or streamed (data.hf_streaming,
diffjax.data.stream: its state resumes exactly, its eval split is apart from its training documents); the trainer
trains from it; what is missing or misspelt is one line naming the data key."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

datasets = pytest.importorskip("datasets")
huggingface_hub = pytest.importorskip("huggingface_hub")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from diffjax.data import make_eval_batches, make_train_dataset, open_documents  # noqa: E402
from diffjax.data import stream  # noqa: E402
from diffjax.data.config import DataConfig  # noqa: E402
from diffjax.data.split import is_eval_text  # noqa: E402
from diffjax.tokenizers import ByteTokenizer  # noqa: E402
from hub_cache import write_cached_repo  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
NAME = "diffjax-tests/tiny-corpus"
SEQ_LEN, BATCH = 64, 4


def corpus() -> list[str]:
    """Documents of varied lengths (the package's own source, cut), a few longer than a row, one empty."""
    source = (REPO_ROOT / "diffjax" / "config.py").read_text()
    cuts = [0] + sorted({(i * i * 37) % len(source) for i in range(1, 40)}) + [len(source)]
    return [source[a:b][:300] for a, b in zip(cuts, cuts[1:])] + [""]


@pytest.fixture(scope="module")
def hub_home(tmp_path_factory):
    """HF_HOME whose Hub cache holds NAME (splits train and validation, parquet, as the Hub's auto-converted
    datasets are laid out), and the same train documents as a jsonl file."""
    root = tmp_path_factory.mktemp("hf-datasets")
    repo = root / "repo"
    (repo / "data").mkdir(parents=True)
    texts = corpus()
    pq.write_table(pa.table({"text": texts, "id": list(range(len(texts)))}), repo / "data" / "train-00000-of-00001.parquet")
    pq.write_table(pa.table({"text": ["held out"] * 3, "id": [0, 1, 2]}), repo / "data" / "validation-00000-of-00001.parquet")
    write_cached_repo(root / "home" / "hub", NAME, {"main": repo}, repo_type="dataset")
    (root / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return root


@pytest.fixture
def offline(hub_home, monkeypatch, tmp_path):
    """This process reads hub_home's cache offline, datasets preparing into tmp_path. huggingface_hub and datasets
    read their settings when first imported (here, already): their constants are set too."""
    home = hub_home / "home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)  # test_lm_eval.py sets it when collected
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "prepared"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "prepared")
    # datasets waits 5 s whenever a shuffled Parquet stream is closed (an Arrow thread issue): at every epoch's end
    # and every resume here, where an epoch is a few batches
    monkeypatch.setattr(datasets.config, "SLEEP_TIME_ON_THREADS_SHUTDOWN", 0)
    return hub_home


def config(**overrides) -> DataConfig:
    fields = {"source": "hf", "hf_dataset": NAME, "seq_len": SEQ_LEN, "eval_fraction": 0.2, "eval_batches": 2,
              "shuffle_window_tokens": 256}
    return DataConfig(**{**fields, **overrides})


def batches(data: DataConfig, count: int, state=None, *, seed: int = 3):
    iterator = iter(make_train_dataset(data, ByteTokenizer(), batch_size=BATCH, seed=seed, shard_index=0, shard_count=1))
    if state is not None:
        iterator.set_state(state)
    return [next(iterator) for _ in range(count)], iterator


def same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(set(x) == set(y) and all(np.array_equal(x[k], y[k]) for k in x) for x, y in zip(a, b))


@pytest.mark.slow
def test_a_cached_hub_dataset_gives_what_its_documents_give_as_a_file(offline):
    """By index: the same documents in the same order, so the same shuffles, eval split and batches as jsonl."""
    as_file = config(source="jsonl", hf_dataset=None, paths=(str(offline / "corpus.jsonl"),))
    assert [open_documents(config())[i] for i in range(len(corpus()))] == corpus()
    assert same(batches(config(), 12)[0], batches(as_file, 12)[0])
    eval_hf = make_eval_batches(config(), ByteTokenizer(), batch_size=BATCH, shard_index=0, shard_count=1)
    assert eval_hf and same(eval_hf, make_eval_batches(as_file, ByteTokenizer(), batch_size=BATCH, shard_index=0,
                                                       shard_count=1))
    assert open_documents(config(hf_split="validation"))[2] == "held out"


@pytest.mark.slow
def test_a_streamed_dataset_gives_the_files_batches_in_stream_order(offline):
    as_file = config(source="jsonl", hf_dataset=None, paths=(str(offline / "corpus.jsonl"),), shuffle=False,
                     eval_fraction=0.0)
    streamed = config(hf_streaming=True, shuffle=False, eval_fraction=0.0)
    assert same(batches(streamed, 12)[0], batches(as_file, 12)[0])  # 12 batches: more than one pass


def test_a_stream_resumes_exactly_and_holds_its_eval_documents_out(offline):
    streamed = config(hf_streaming=True)
    first, iterator = batches(streamed, 5)
    state = json.loads(json.dumps(iterator.get_state()))
    after = [next(iterator) for _ in range(9)]  # into the next epochs: reshuffled
    assert same(batches(streamed, 9, state)[0], after)
    assert not same(first, batches(streamed, 5, seed=4)[0])  # the seed shuffles
    source, unshuffled = open_documents(streamed), config(hf_streaming=True, shuffle=False)
    held_out = [t for t in corpus() if is_eval_text(t, 0.2)]
    trained = [t for t in corpus() if not is_eval_text(t, 0.2)]
    train_pass = stream.train_documents(source, unshuffled, seed=3, shard_index=0, shard_count=1)
    assert list(itertools.islice(iter(train_pass), 2 * len(trained))) == 2 * trained and held_out
    assert list(stream.eval_documents(source, streamed, shard_index=0, shard_count=1)) == held_out
    shards = [list(stream.eval_documents(source, config(hf_streaming=True, eval_fraction=0.9), shard_index=i,
                                         shard_count=2)) for i in (0, 1)]
    assert sorted(shards[0] + shards[1]) == sorted(t for t in corpus() if is_eval_text(t, 0.9)) and all(shards)


def test_a_stream_with_no_training_document_is_one_error_not_a_hang(offline):
    with pytest.raises(ValueError, match="no document of a whole pass is a training document"):
        batches(config(hf_streaming=True, hf_split="validation", eval_fraction=0.999), 1)


@pytest.mark.parametrize("overrides, message", [
    ({"hf_dataset": "diffjax-tests/absent"}, "data.hf_dataset diffjax-tests/absent is not a local directory and is "
                                             "not in the Hugging Face cache"),
    ({"hf_dataset": "diffjax-tests/absent", "hf_revision": "v2"}, "`hf download diffjax-tests/absent --repo-type "
                                                                  "dataset --revision v2`"),
    ({"hf_split": "tset"}, "data.hf_split 'tset': Unknown split \"tset\""),
    ({"hf_config": "wikitext"}, "data.hf_config 'wikitext': BuilderConfig 'wikitext' not found"),
    ({"text_field": "content"}, "no column 'content' (columns: ['text', 'id']); set data.text_field"),
    ({"text_field": "id"}, "column 'id' must hold strings, got int"),
])
def test_what_is_missing_or_misspelt_is_one_line(offline, overrides, message):
    with pytest.raises((ValueError, FileNotFoundError)) as raised:
        source = open_documents(config(**overrides))
        source[0]
    assert message in str(raised.value) and "\n" not in str(raised.value)
    if "absent" in str(overrides):
        assert "offline mode is on (HF_HUB_OFFLINE set in your environment)" in str(raised.value)


@pytest.mark.parametrize("fields, message", [
    ({"source": "hf"}, "data.source 'hf' needs data.hf_dataset"),
    ({"source": "hf", "hf_dataset": NAME, "paths": ("a.jsonl",)}, "data.paths is for files"),
    ({"source": "jsonl", "paths": ("a.jsonl",), "hf_split": "test"}, "data.hf_split is for data.source 'hf'"),
    ({"source": "hf", "hf_dataset": NAME, "hf_streaming": True, "worker_count": 2}, "set data.worker_count 0"),
])
def test_the_config_names_the_keys_of_each_source(fields, message):
    with pytest.raises(ValueError, match=message):
        DataConfig(**fields)


@pytest.mark.slow
def test_the_trainer_trains_from_a_dataset_in_the_hub_cache(hub_home, tmp_path):
    """`diffjax-train data.source=hf data.hf_dataset=org/name` offline, as a user would type it."""
    env = {"HF_HOME": str(hub_home / "home"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "prepared"),
           "PYTHONPATH": str(REPO_ROOT)}
    command = [sys.executable, str(REPO_ROOT / "train.py"), "data.source=hf", f"data.hf_dataset={NAME}",
               "data.seq_len=64", "data.eval_fraction=0.2", "data.eval_batches=1", "data.shuffle_window_tokens=256",
               "model.d_model=32", "model.num_layers=1", "model.max_seq_len=64", "train.batch_size=4",
               "train.steps=3", "train.eval_every=3", "train.log_every=1", "train.sample_tokens=0",
               f"train.run_dir={tmp_path / 'run'}", "checkpoint.every=3"]
    env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    result = subprocess.run(command, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "done at step 3" in result.stdout
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert f"hf_dataset: {NAME}" in saved and "source: hf" in saved


def test_a_tokenizer_trains_on_a_dataset_in_the_hub_cache(offline, tmp_path, capsys):
    """`python -m diffjax.data train-sentencepiece --source hf --hf-dataset NAME` reads the split as the trainer does."""
    from diffjax.data.__main__ import main
    from diffjax.tokenizers.sentencepiece_tokenizer import SentencePieceTokenizer

    output = tmp_path / "hf.model"
    assert main(["train-sentencepiece", "--output", str(output), "--vocab-size", "400", "--source", "hf",
                 "--hf-dataset", NAME, "--hf-split", "train"]) == 0
    assert f"{len(corpus())} documents" in capsys.readouterr().out
    assert SentencePieceTokenizer(output).decode(SentencePieceTokenizer(output).encode(corpus()[1])) == corpus()[1]
