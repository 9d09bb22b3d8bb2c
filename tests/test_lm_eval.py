"""The lm-evaluation-harness adapter (diffjax.eval) against lm_eval's own Hugging Face backend.

lm_eval's evaluator runs three local tasks (written here: task YAML + JSON lines, nothing downloaded) on a small
random DiffLlama and a Llama (both GQA), each saved as a Hugging Face directory with a BPE tokenizer trained on
this file's text, and converted to a diffjax run directory: once with model "diffjax" on the conversion, once
with model "hf" on the HF directory (fp32, cpu). Per sample: the multiple-choice loglikelihoods and greedy flags,
the rolling (perplexity) loglikelihoods and the greedy generate_until texts agree. max_length 64 makes the long
question and the long prompt left-truncate and the long documents take several rolling windows; " A" / " B"
answers share one forward row; generations end at eos, at a stop string or at max_gen_toks.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import numpy as np
import pytest

# lm_eval's datasets read the tasks' local JSON files only; nothing may reach the network
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="diffjax-test-datasets-"))

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="lm_eval's Hugging Face backend (the reference) needs accelerate")
lm_eval = pytest.importorskip("lm_eval")

from hf_models import make_hf_model  # noqa: E402

MAX_LENGTH = 64
LL_RTOL = 1e-4  # fp32: |ours - HF's| / |HF's| per sample (measured ~1e-6)
BF16_RTOL = 1e-2  # a bf16 model's sums of log-probs against fp32's (measured ~1e-3)
CORPUS = [
    "the quick brown fox jumps over the lazy dog.",
    "a cat sat on the mat and the dog ran to the park.",
    "question: what is two plus two? answer: four.",
    "question: which animal barks? answer: the dog.",
    "the sun rises in the east and sets in the west.",
    "water boils at one hundred degrees, ice melts at zero.",
    "she sells sea shells by the sea shore, he reads a book.",
]
CHOICE_DOCS = [
    {"question": "what is two plus two?", "choices": [" four", " five", " the dog"], "label": 0},
    {"question": "which animal barks?", "choices": [" A", " B", " C", " D"], "label": 1},
    {"question": "where does the sun rise?", "choices": [" A", " B", " C", " D"], "label": 2},
    {"question": " ".join(CORPUS), "choices": [" in the east", " west", " at zero"], "label": 0},  # > MAX_LENGTH
    {"question": "who reads a book?", "choices": [" she", " he sells sea shells by the sea shore"], "label": 1},
]
ROLLING_DOCS = [{"text": CORPUS[0]}, {"text": " ".join(CORPUS[:4])}, {"text": " ".join(CORPUS[2:] * 2)}]
GEN_DOCS = [{"prompt": "question: what is two plus two? answer:", "answer": " four"},
            {"prompt": "the sun", "answer": " rises"},
            {"prompt": " ".join(CORPUS[:4]) + " the quick brown", "answer": " fox"}]  # > MAX_LENGTH - max_gen_toks
TASKS = {
    "dj_choice": (CHOICE_DOCS, """
output_type: multiple_choice
doc_to_text: "Q: {{question}}\\nA:"
doc_to_choice: "{{choices}}"
doc_to_target: label
metric_list:
  - metric: acc
"""),
    "dj_rolling": (ROLLING_DOCS, """
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
"""),
    "dj_gen": (GEN_DOCS, """
output_type: generate_until
doc_to_text: "{{prompt}}"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["\\n", "o", "a"]
  max_gen_toks: 16
  do_sample: false
metric_list:
  - metric: exact_match
"""),
}


def write_tasks(directory):
    """Task YAMLs reading JSON-lines files beside them (lm_eval's `json` dataset builder: no download)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, (docs, body) in TASKS.items():
        data = directory / f"{name}.jsonl"
        data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
        (directory / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n" + body)
    return directory


def train_tokenizer():
    """A byte-level BPE tokenizer trained on CORPUS, which adds <s> in front (as Llama's does); ids 0, 1, 2:
    <pad>, <s>, </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<pad>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


MODELS = {"diffllama": dict(num_key_value_heads=4), "llama": dict(num_key_value_heads=2)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{kind: (HF directory, converted run directory)} and the tasks' directory."""
    from diffjax.convert import hf_to_diffjax

    root = tmp_path_factory.mktemp("lm_eval")
    tokenizer = train_tokenizer()
    made = {}
    for kind, overrides in MODELS.items():
        hf = make_hf_model(kind, seed=1, num_hidden_layers=2, vocab_size=len(tokenizer), max_position_embeddings=128,
                           pad_token_id=0, bos_token_id=1, eos_token_id=2, **overrides)
        with torch.no_grad():  # eos likelier: some rows end at it (one at once), the others at a stop string or the budget
            hf.lm_head.weight[2] *= 3
        hf_dir, run_dir = root / f"{kind}-hf", root / f"{kind}-run"
        hf.save_pretrained(hf_dir)
        tokenizer.save_pretrained(hf_dir)
        hf_to_diffjax(hf_dir, run_dir)
        made[kind] = (hf_dir, run_dir)
    return made, write_tasks(root / "tasks")


def evaluate(model, model_args, tasks_dir, tasks=tuple(TASKS), **options):
    from lm_eval.tasks import TaskManager

    import diffjax.eval.lm_eval_adapter  # noqa: F401  (registers "diffjax")

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(tasks),
                                   task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False),
                                   log_samples=True, bootstrap_iters=0, **options)


def responses(results, task):
    """Each sample's responses, in document order: [(loglikelihood, greedy), ...] per choice (multiple choice),
    the document's loglikelihood (rolling), the generated text (generate_until)."""
    samples = sorted(results["samples"][task], key=lambda sample: sample["doc_id"])
    if task == "dj_choice":
        return [[tuple(r[0]) for r in sample["resps"]] for sample in samples]
    return [sample["resps"][0][0] for sample in samples]


@pytest.fixture(scope="module")
def diffjax_results(checkpoints):
    """lm_eval's evaluator with model "diffjax" on each conversion (a run directory), once per module."""
    (made, tasks_dir), results = checkpoints, {}
    for kind, (_, run_dir) in made.items():
        results[kind] = evaluate("diffjax", {"pretrained": str(run_dir), "max_length": MAX_LENGTH, "batch_size": 4}, tasks_dir)
    return results


def max_rel_err(ours, theirs) -> float:
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    return float(np.max(np.abs(ours - theirs) / np.abs(theirs)))


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.slow
def test_scores_and_generations_equal_lm_evals_hf_backend(kind, checkpoints, diffjax_results, measured):
    (hf_dir, _), tasks_dir = checkpoints[0][kind], checkpoints[1]
    ours = diffjax_results[kind]
    theirs = evaluate("hf", {"pretrained": str(hf_dir), "dtype": "float32", "device": "cpu", "max_length": MAX_LENGTH,
                             "batch_size": 4}, tasks_dir)

    ours_choice, theirs_choice = responses(ours, "dj_choice"), responses(theirs, "dj_choice")
    lls = [[ll for ll, _ in doc] for doc in ours_choice], [[ll for ll, _ in doc] for doc in theirs_choice]
    error = measured(f"{kind} multiple-choice loglikelihoods, max rel err", max_rel_err(*(sum(x, []) for x in lls)), LL_RTOL)
    assert error <= LL_RTOL, lls
    assert [[g for _, g in doc] for doc in ours_choice] == [[g for _, g in doc] for doc in theirs_choice]
    assert ours["results"]["dj_choice"]["acc,none"] == theirs["results"]["dj_choice"]["acc,none"]

    ours_rolling, theirs_rolling = responses(ours, "dj_rolling"), responses(theirs, "dj_rolling")
    error = measured(f"{kind} rolling loglikelihoods, max rel err", max_rel_err(ours_rolling, theirs_rolling), LL_RTOL)
    assert error <= LL_RTOL, (ours_rolling, theirs_rolling)

    texts = responses(ours, "dj_gen")
    assert texts == responses(theirs, "dj_gen") and any(texts), texts


def test_byte_tokenizer_scores_equal_a_plain_forward(checkpoints, measured):
    """The adapter's scoring against log_softmax of one plain forward pass per request, with the byte tokenizer
    (no special tokens; the prefix token is its eos 256): an empty context, a trailing space moved into the
    continuation, two continuations sharing a row, a context truncated from the left, and a rolling document."""
    import jax
    from lm_eval.api.instance import Instance

    from diffjax.checkpoint import load_model
    from diffjax.eval import DiffjaxLM

    model = load_model(checkpoints[0]["diffllama"][1])
    lm = DiffjaxLM(model=model, tokenizer="byte", batch_size=4, max_length=MAX_LENGTH)
    pairs = [("", "hello"), ("the cat ", "sat"), ("the cat", " sab"), ("the cat", " sac"), ("x" * 90, " the end")]
    ours = lm.loglikelihood([Instance("loglikelihood", {}, pair, 0) for pair in pairs], disable_tqdm=True)
    document = " ".join(CORPUS[:3])
    rolling = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (document,), 0)], disable_tqdm=True)

    forward = jax.jit(lambda tokens: jax.nn.log_softmax(model(tokens[None])[0]))

    def score(context: list[int], continuation: list[int]) -> tuple[float, bool]:
        whole = (context + continuation)[-(MAX_LENGTH + 1):]
        logp = np.asarray(forward(np.asarray(whole[:-1], np.int32)))[-len(continuation):]
        return float(logp[np.arange(len(continuation)), continuation].sum()), bool((logp.argmax(-1) == continuation).all())

    def encode(text: str) -> list[int]:
        return list(text.encode())

    expected = [score([256], encode("hello")), score(encode("the cat"), encode(" sat")), score(encode("the cat"), encode(" sab")),
                score(encode("the cat"), encode(" sac")), score(encode("x" * 90), encode(" the end"))]
    tokens = encode(document)  # windows of MAX_LENGTH predictions: the first conditioned on eos, each next on the tokens before
    starts = range(0, len(tokens), MAX_LENGTH)
    expected_rolling = sum(score(([256] + tokens)[max(0, start - MAX_LENGTH + 1) : start + 1] if start else [256],
                                 tokens[start : start + MAX_LENGTH])[0] for start in starts)
    error = measured("byte tokenizer: adapter vs plain forward, max rel err",
                     max_rel_err([ll for ll, _ in ours] + rolling, [ll for ll, _ in expected] + [expected_rolling]), 1e-5)
    assert error <= 1e-5
    assert [g for _, g in ours] == [g for _, g in expected]

    # dtype="bfloat16": a bf16 copy of the model (params and compute), within bf16's rounding of the fp32 scores
    lm16 = DiffjaxLM(model=model, tokenizer="byte", batch_size=4, max_length=MAX_LENGTH, dtype="bfloat16")
    assert lm16.config.dtype == "bfloat16" and {x.dtype for x in jax.tree.leaves(lm16.params)} == {np.dtype("bfloat16")}
    ours16 = [ll for ll, _ in lm16.loglikelihood([Instance("loglikelihood", {}, pair, 0) for pair in pairs], disable_tqdm=True)]
    error = measured("bf16 adapter vs fp32 plain forward, max rel err", max_rel_err(ours16, [ll for ll, _ in expected]), BF16_RTOL)
    assert 0 < error <= BF16_RTOL


def test_a_context_axis_scores_as_one_device(checkpoints, measured):
    """A mesh with the trainer's context axis splits each scored sequence (data=2 x context=3: 6 chunks per row, so
    the length buckets round up to multiples of 6) and scores as one device does; generation refuses it by name."""
    from lm_eval.api.instance import Instance

    from diffjax.checkpoint import load_model
    from diffjax.eval import DiffjaxLM

    model = load_model(checkpoints[0]["diffllama"][1])
    one, split = (DiffjaxLM(model=model, tokenizer="byte", batch_size=4, max_length=60, mesh=mesh)
                  for mesh in (None, "data=2,context=3"))
    assert dict(split.mesh.shape) == {"data": 2, "fsdp": 1, "context": 3, "tensor": 1, "expert": 1}
    pairs = [("", "hello"), ("the cat ", "sat"), ("x" * 90, " the end")]  # rows of 5, 10 and 60 tokens
    ours, theirs = (lm.loglikelihood([Instance("loglikelihood", {}, pair, 0) for pair in pairs], disable_tqdm=True)
                    for lm in (split, one))
    error = measured("data=2 x context=3 vs one device, max rel err", max_rel_err([ll for ll, _ in ours], [ll for ll, _ in theirs]), 1e-5)
    assert error <= 1e-5 and [g for _, g in ours] == [g for _, g in theirs]
    with pytest.raises(ValueError, match="generate_until: KV-cached decoding does not split the sequence, but the mesh "
                                         "has context=3: run generation tasks on a mesh without a context axis"):
        split.generate_until([Instance("generate_until", {}, ("the cat", {"until": ["."]}), 0)], disable_tqdm=True)
    with pytest.raises(ValueError, match=r"max_length 64 must be a multiple of 2 x the mesh's context \(6\)"):
        DiffjaxLM(model=model, tokenizer="byte", batch_size=4, max_length=MAX_LENGTH, mesh="data=2,context=3")


@pytest.mark.slow
def test_cli_on_the_hf_directory_under_a_mesh(checkpoints, diffjax_results, tmp_path, capsys, measured):
    """python -m diffjax.eval on the HF directory itself, batches split over data=2 (of the 8 simulated CPU
    devices): the per-sample scores of the run directory on one device."""
    from diffjax.eval.__main__ import main

    (hf_dir, _), tasks_dir = checkpoints[0]["diffllama"], checkpoints[1]
    output = tmp_path / "results.json"
    assert main(["--model-path", str(hf_dir), "--tasks", "dj_choice,dj_gen", "--include-path", str(tasks_dir),
                 "--batch-size", "4", "--max-length", str(MAX_LENGTH), "--mesh", "data=2", "--output", str(output),
                 "--log-samples"]) == 0
    out = capsys.readouterr().out
    assert "dj_choice" in out and "acc" in out  # lm_eval's table
    written = json.loads(output.read_text())
    expected = diffjax_results["diffllama"]
    error = measured("CLI (HF dir, data=2) vs API (run dir), max rel err",
                     max_rel_err([ll for doc in responses(written, "dj_choice") for ll, _ in doc],
                                 [ll for doc in responses(expected, "dj_choice") for ll, _ in doc]), 1e-5)
    assert error <= 1e-5
    assert responses(written, "dj_gen") == responses(expected, "dj_gen")


@pytest.mark.parametrize("args, message", [
    (lambda tmp, tasks: ["--model-path", str(tmp / "absent"), "--tasks", "dj_choice", "--include-path", str(tasks)],
     "error: --model-path: {tmp}/absent does not exist\n"),
    (lambda tmp, tasks: ["--model-path", str(tmp), "--tasks", "dj_choice", "--include-path", str(tasks)],
     "error: --model-path: no checkpoint under {tmp}\n"),
    (lambda tmp, tasks: ["--model-path", "{run}", "--tasks", "dj_choice,nonexistent_task", "--include-path", str(tasks),
                         "--no-builtin-tasks"],
     "error: --tasks: unknown task(s) nonexistent_task (not in --include-path {tasks}; `python -m lm_eval ls tasks` lists "
     "lm_eval's)\n"),
    (lambda tmp, tasks: ["--model-path", "{run}", "--tasks", "dj_choice", "--include-path", str(tasks), "--mesh", "pipe=2"],
     "error: mesh 'pipe=2': expected axis=size items, each of the axes ('data', 'fsdp', 'context', 'tensor', 'expert') at most "
     "once (e.g. data=4,tensor=2); got 'pipe=2'\n"),
    (lambda tmp, tasks: ["--model-path", "{run}", "--tasks", "dj_choice", "--include-path", str(tasks), "--mesh", "data=0"],
     "error: mesh 'data=0': parallel.data must be a positive integer or -1 (fill), got 0\n"),
    (lambda tmp, tasks: ["--model-path", "{run}", "--tasks", "dj_choice", "--include-path", str(tasks), "--mesh", "data=16"],
     "error: mesh 'data=16' does not fit the 8 devices\n"),
])
def test_cli_bad_input_is_one_line_and_exit_2(args, message, checkpoints, tmp_path, capsys):
    from diffjax.eval.__main__ import main

    run_dir, tasks_dir = checkpoints[0]["llama"][1], checkpoints[1]
    argv = [arg.replace("{run}", str(run_dir)) for arg in args(tmp_path, tasks_dir)]
    assert main(argv) == 2
    assert capsys.readouterr().err == message.format(tmp=tmp_path, tasks=tasks_dir)


def test_importing_diffjax_or_its_trainer_loads_no_lm_eval():
    """lm_eval (and torch) load only when the adapter is used: not with diffjax, diffjax.train or diffjax.eval."""
    import subprocess

    script = ("import sys, diffjax, diffjax.train, diffjax.eval\n"
              "print(sorted({m.split('.')[0] for m in sys.modules} & {'lm_eval', 'torch', 'datasets', 'transformers'}))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stdout
