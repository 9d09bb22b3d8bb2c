"""Checkpoints by their Hugging Face Hub name (diffjax.convert.hub): `load_hf("org/name")`, the convert CLI's
hf-to-diffjax / verify / upcycle and eval read the standard huggingface_hub cache, as transformers'
`from_pretrained("org/name")` does, offline and with no network: the cache is written by hand in the layout
huggingface_hub keeps (tests/hub_cache.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
huggingface_hub = pytest.importorskip("huggingface_hub")

import diffjax  # noqa: E402
from diffjax.convert import hub  # noqa: E402
from diffjax.convert.__main__ import main  # noqa: E402
from hf_models import make_hf_model, max_relative_error, random_tokens  # noqa: E402
from hub_cache import commit_of, write_cached_repo  # noqa: E402

FP32_TOL = 1e-5  # as tests/test_hf_equivalence.py's
REPO_ROOT = Path(__file__).resolve().parents[1]
NAME = "diffjax-tests/tiny-diffllama"
LLAMA = "diffjax-tests/tiny-llama"


@pytest.fixture(scope="module")
def hub_home(tmp_path_factory):
    """(HF_HOME, {revision: the transformers model cached as NAME there}): main and the branch "v2", other weights."""
    root = tmp_path_factory.mktemp("hub")
    models, saved = {}, {}
    for seed, revision in enumerate(("main", "v2")):
        models[revision] = make_hf_model("diffllama", seed=seed, num_key_value_heads=4)
        saved[revision] = root / "saved" / revision
        models[revision].save_pretrained(saved[revision])
    write_cached_repo(root / "home" / "hub", NAME, saved)
    make_hf_model("llama", num_key_value_heads=4).save_pretrained(root / "saved" / "llama")
    write_cached_repo(root / "home" / "hub", LLAMA, {"main": root / "saved" / "llama"})
    return root / "home", models


@pytest.fixture
def offline(hub_home, monkeypatch):
    """This process reads hub_home's cache offline. huggingface_hub reads HF_HOME and HF_HUB_OFFLINE when first
    imported (here, already): its constants are set too. Subprocesses get the environment."""
    home, models = hub_home
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return models


def transformers_logits(name: str, tokens, **kwargs) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="eager", **kwargs).eval()
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


@pytest.mark.parametrize("revision", [None, "v2", commit_of("v2")])
def test_load_hf_by_name_reads_what_from_pretrained_reads(offline, revision, measured):
    tokens = random_tokens(offline["main"].config.vocab_size)
    kwargs = {} if revision is None else {"revision": revision}
    expected = transformers_logits(NAME, tokens, **kwargs)
    ours = np.asarray(diffjax.load_hf(NAME, **kwargs)(jnp.asarray(tokens)))
    err = measured(f"load_hf({NAME!r}, revision={revision}) logits max rel err", max_relative_error(ours, expected))
    assert err <= FP32_TOL
    other = transformers_logits(NAME, tokens, revision="main" if revision else "v2")
    assert max_relative_error(ours, other) > 0.1  # the revision read is the one asked for


def test_a_local_directory_wins_over_the_hub_name(offline, tmp_path, monkeypatch):
    local = tmp_path / NAME
    offline["v2"].save_pretrained(local)
    monkeypatch.chdir(tmp_path)
    assert hub.resolve(NAME) == NAME  # the relative path, as given
    tokens = random_tokens(offline["v2"].config.vocab_size)
    ours = np.asarray(diffjax.load_hf(NAME)(jnp.asarray(tokens)))
    assert max_relative_error(ours, transformers_logits(str(local), tokens)) <= FP32_TOL
    with pytest.raises(ValueError, match=r"revision 'v2' applies to a Hugging Face Hub name .* a local path"):
        diffjax.load_hf(NAME, revision="v2")


def test_eval_loads_a_hub_name(offline):
    """diffjax.eval's loader (the --model-path / pretrained= of lm_eval's diffjax model) reads names as load_hf does."""
    pytest.importorskip("lm_eval")
    from diffjax.eval.lm_eval_adapter import load_for_eval

    tokens = jnp.asarray(random_tokens(offline["v2"].config.vocab_size))
    model, _ = load_for_eval(NAME, revision="v2", tokenizer="byte")
    np.testing.assert_array_equal(np.asarray(model(tokens)), np.asarray(diffjax.load_hf(NAME, revision="v2")(tokens)))


@pytest.mark.parametrize("name,revision,message", [
    ("diffjax-tests/not-cached", None, r"^diffjax-tests/not-cached is not a local directory and is not \(fully\) in "
     r"the Hugging Face cache .*hub, and offline mode is on \(HF_HUB_OFFLINE set in your environment\); fetch it with "
     r"`hf download diffjax-tests/not-cached` where the Hub is reachable"),
    (NAME, "v3", rf"^{NAME} at revision 'v3' is not a local directory .*`hf download {NAME} --revision v3`"),
])
def test_offline_and_not_cached_is_one_line(offline, name, revision, message):
    with pytest.raises(FileNotFoundError, match=message) as raised:
        diffjax.load_hf(name, revision=revision)
    assert "\n" not in str(raised.value)
    assert raised.value.__cause__ is None and raised.value.__context__ is None  # no chained traceback


def test_offline_mode_diffjax_switched_on_says_so(offline, monkeypatch):
    """diffjax-eval goes offline when the Hub does not answer: a name it then cannot read says diffjax did it."""
    from diffjax.convert.hub import OFFLINE_REASON

    monkeypatch.setenv(OFFLINE_REASON, "the Hub (https://huggingface.co) did not answer within 5 s")
    with pytest.raises(FileNotFoundError, match=r"and diffjax switched to offline mode \(set HF_HUB_OFFLINE\) because "
                                                r"the Hub \(https://huggingface.co\) did not answer within 5 s; fetch"):
        diffjax.load_hf("diffjax-tests/not-cached")


def test_without_huggingface_hub_a_name_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # as if not installed
    with pytest.raises(FileNotFoundError, match=r"^org/name is not a local directory; reading it as a Hugging Face Hub "
                                                r"name needs huggingface_hub: pip install 'diffjax\[hub\]'$"):
        diffjax.load_hf("org/name")


def test_only_the_files_diffjax_reads_are_fetched():
    """The patterns snapshot_download is given, on a repository's files (huggingface_hub's own filter)."""
    from huggingface_hub.utils import filter_repo_objects

    files = ["config.json", "generation_config.json", "model-00001-of-00002.safetensors",
             "model-00002-of-00002.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "tokenizer.json",
             "tokenizer_config.json", "special_tokens_map.json", "modeling_motif.py", "README.md", ".gitattributes",
             "original/consolidated.00.pth", "onnx/model.safetensors"]

    def fetched(patterns):
        return set(filter_repo_objects(files, allow_patterns=list(patterns), ignore_patterns=list(hub._TOP_LEVEL_ONLY)))

    wanted = {"config.json", "generation_config.json", "model-00001-of-00002.safetensors", "tokenizer.json",
              "model-00002-of-00002.safetensors", "model.safetensors.index.json", "tokenizer_config.json",
              "special_tokens_map.json", "README.md"}
    assert fetched(hub.CONFIG_AND_TOKENIZER + hub.SAFETENSORS) == wanted
    assert fetched(hub.CONFIG_AND_TOKENIZER + hub.SAFETENSORS + hub.REMOTE_CODE) == wanted | {"modeling_motif.py"}
    assert fetched(hub.PYTORCH_BIN) == {"pytorch_model.bin"}


@pytest.mark.slow
def test_the_convert_cli_by_name(offline, tmp_path, capsys):
    """hf-to-diffjax, verify and upcycle of a Hub name (and its revision), in this process."""
    assert main(["hf-to-diffjax", NAME, str(tmp_path / "run"), "--revision", "v2"]) == 0
    assert main(["verify", NAME, "--revision", "v2", "--diffjax", str(tmp_path / "run"), "--prompts", "1",
                 "--seq-len", "16"]) == 0
    report = capsys.readouterr().out
    assert f"verify {NAME}:" in report and "PASS" in report
    assert main(["verify", NAME, "--diffjax", str(tmp_path / "run"), "--prompts", "1", "--seq-len", "16"]) == 1
    assert "FAIL" in capsys.readouterr().out  # main's weights are not v2's conversion
    assert main(["upcycle", LLAMA, str(tmp_path / "upcycled")]) == 0
    assert (tmp_path / "upcycled" / "hf" / "config.json").is_file()  # the source's files, kept as from a directory


def test_nothing_is_written_into_the_hugging_face_cache(offline, hub_home, tmp_path, capsys):
    """The probe: `hf-to-diffjax org/name <its snapshot> --overwrite`. Before: config.yaml and checkpoints/ written
    into the cache, rc 0 (issue 55 item 5). Any other directory of the cache is refused as well, and exports too."""
    cache = hub_home[0] / "hub"
    snapshot = hub.resolve(NAME)
    listing = sorted(str(p) for p in cache.rglob("*"))
    for argv in (["hf-to-diffjax", NAME, str(snapshot), "--overwrite"],
                 ["hf-to-diffjax", str(tmp_path / "elsewhere"), str(cache / "mine")],
                 ["diffjax-to-hf", str(tmp_path / "elsewhere"), str(cache / "exported")]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and err.startswith("error: "), err
        assert "is in the Hugging Face cache" in err or "is SRC" in err, err
    assert sorted(str(p) for p in cache.rglob("*")) == listing


def run_cli(*args, **env):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "JAX_PLATFORMS": "cpu", **env}
    for key in ("HF_HUB_OFFLINE", "HF_HUB_CACHE", "HF_ENDPOINT"):
        if env.get(key) is None:
            env.pop(key, None)
    return subprocess.run([sys.executable, "-m", "diffjax.convert", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=REPO_ROOT, timeout=300)


@pytest.mark.slow
def test_the_cli_honours_hf_home_and_offline_mode(hub_home, tmp_path):
    """Real subprocesses, configured by the environment only: HF_HOME + HF_HUB_OFFLINE=1 read the cache; a name not
    in it is one line and exit 2, offline or with the Hub unreachable (no retries)."""
    home, _ = hub_home
    done = run_cli("hf-to-diffjax", NAME, tmp_path / "run", HF_HOME=str(home), HF_HUB_OFFLINE="1")
    assert done.returncode == 0, done.stderr
    done = run_cli("verify", NAME, "--diffjax", tmp_path / "run", "--prompts", "1", "--seq-len", "16",
                   HF_HOME=str(home), HF_HUB_OFFLINE="1")
    assert done.returncode == 0 and "PASS" in done.stdout, done.stdout + done.stderr
    done = run_cli("upcycle", "diffjax-tests/not-cached", tmp_path / "up", HF_HOME=str(home), HF_HUB_OFFLINE="1")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert ("offline mode is on (HF_HUB_OFFLINE set in your environment); fetch it with `hf download "
            "diffjax-tests/not-cached`") in done.stderr
    start = time.monotonic()
    done = run_cli("verify", "diffjax-tests/not-cached", HF_HOME=str(home), HF_HUB_OFFLINE=None,
                   HF_ENDPOINT="http://127.0.0.1:9")  # nothing listens there: as with no network
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "the Hub could not be reached" in done.stderr and time.monotonic() - start < 60
