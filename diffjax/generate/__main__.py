"""diffjax-generate --checkpoint DIR --prompt TEXT [--prompt TEXT ...] [--max-new-tokens N ...]

Continues each prompt with the model of a run directory (diffjax-train's, or a conversion's) and prints prompt +
continuation, one after the other; several prompts of any lengths run as one batch. Text goes through the
run's tokenizer (config.yaml's data.tokenizer); --prompt-ids takes token ids instead and needs none.
A row stops at the tokenizer's eos (unless --ignore-eos) or after --max-new-tokens.
Exit status: 0 done, 2 bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from diffjax import command_line
from diffjax.log_lines import print_package_logs
from diffjax.run_dir import RunDir

SEPARATOR = "\n" + "-" * 40


def _parser() -> argparse.ArgumentParser:
    parser = command_line.ArgumentParser(prog="diffjax-generate", description="Continue prompts with the model of a run directory (KV-cached generation).")
    parser.add_argument("--checkpoint", required=True, metavar="DIR",
                        help="a run directory (diffjax-train's or a conversion's), its checkpoints/ directory or a step directory")
    prompts = parser.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt (repeat for a batch)")
    prompts.add_argument("--prompt-ids", action="append", metavar="IDS",
                         help="a prompt as comma-separated token ids (repeat for a batch); prints ids, needs no tokenizer")
    parser.add_argument("--max-new-tokens", type=int, default=100, help="new tokens per prompt at most (default 100)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 (the default): greedy")
    parser.add_argument("--top-k", type=int, help="sample from the k most likely tokens only")
    parser.add_argument("--top-p", type=float, help="sample from the most likely tokens whose probability reaches p")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at the tokenizer's eos token")
    parser.add_argument("--draft", choices=["mtp"], help="mtp: self-speculative decoding, the model's MTP depths "
                        "draft and the model verifies (greedy only, the same tokens; prints when done)")
    return parser


def load_tokenizer(step_dir: Path):
    """The tokenizer a run directory's config.yaml names (data.tokenizer); an error naming the fix if none."""
    from diffjax.config_values import read_yaml_mapping
    from diffjax.tokenizers import TokenizerConfig, make_tokenizer

    run = RunDir.of_step(step_dir)
    config_path = run.config_file
    if not config_path.exists():
        raise FileNotFoundError(f"--checkpoint: {config_path} is missing: cannot tell the model or its tokenizer")
    section = (read_yaml_mapping(config_path).get("data") or {}).get("tokenizer")
    if not isinstance(section, dict):
        hint = f" (a conversion keeps its source's tokenizer files in {run.hf})" if run.hf.is_dir() else ""
        example = f"{{kind: hf, path: {run.hf}}}" if run.hf.is_dir() else "{kind: sentencepiece, path: tokenizer.model}"
        raise ValueError(f"{config_path} names no tokenizer (data.tokenizer){hint}: add one, e.g. `data: {{tokenizer: "
                         f"{example}}}`, or pass --prompt-ids")
    return make_tokenizer(TokenizerConfig(**section))


def _ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.replace(",", " ").split()]
    except ValueError:
        raise ValueError(f"--prompt-ids takes comma-separated integers, got {text!r}") from None


def _check_lengths(prompts: list[list[int]], max_new_tokens: int, max_seq_len: int, flag: str) -> None:
    """Every prompt has a token, and the longest plus --max-new-tokens fits the model's context."""
    for number, prompt in enumerate(prompts, 1):
        if len(prompt) == 0:
            raise ValueError(f"{flag} {number} is empty (no tokens): every prompt needs at least one")
    number, longest = max(enumerate(map(len, prompts), 1), key=lambda item: item[1])
    if longest + max_new_tokens > max_seq_len:
        raise ValueError(f"{flag} {number} is {longest} tokens; with --max-new-tokens {max_new_tokens} that is "
                         f"{longest + max_new_tokens}, more than the model's context (max_seq_len {max_seq_len}): "
                         f"shorten the prompt or lower --max-new-tokens")


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    print_package_logs()
    import jax

    from diffjax.generate.generation import generate
    from diffjax.params_checkpoint import load_model, resolve_checkpoint

    try:
        if args.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
        step_dir = resolve_checkpoint(args.checkpoint, what="--checkpoint")
        tokenizer = None if args.prompt_ids else load_tokenizer(step_dir)
        model = load_model(step_dir, what="--checkpoint")
        if tokenizer is not None and tokenizer.vocab_size > model.config.vocab_size:
            raise ValueError(f"the tokenizer ({tokenizer.name}, {tokenizer.vocab_size} ids) does not fit the model's "
                             f"vocabulary ({model.config.vocab_size})")
        prompts = [_ids(text) for text in args.prompt_ids] if tokenizer is None else [tokenizer.encode(t) for t in args.prompt]
        flag = "--prompt-ids" if tokenizer is None else "--prompt"
        _check_lengths(prompts, args.max_new_tokens, model.config.max_seq_len, flag)
        eos = None if tokenizer is None or args.ignore_eos else tokenizer.eos_id
        # One text prompt streams as it is generated; a batch (or ids) prints when done.
        streams = tokenizer is not None and len(prompts) == 1 and args.draft is None
        printer = _StreamPrinter(tokenizer, eos, args.prompt[0]) if streams else None
        clock, acceptance, timings = _Clock(printer), [], []
        new_tokens = generate(
            model, prompts, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
            stop_tokens=() if eos is None else (eos,), key=jax.random.key(args.seed),
            on_tokens=clock if args.draft is None else None,
            allowed_vocab_size=None if tokenizer is None else tokenizer.vocab_size,
            blocked_ids=() if tokenizer is None else tokenizer.undecodable_ids(), draft=args.draft, acceptance=acceptance,
            timings=timings)
    except (ValueError, TypeError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    count = 0
    for i, (prompt, row) in enumerate(zip(prompts, new_tokens)):
        if eos is not None and eos in row:
            row = row[: list(row).index(eos) + 1]
        count += len(row)
        if printer is not None:
            printer.finish(row)
        elif tokenizer is None:
            print(" ".join(map(str, list(prompt) + list(row))))
        else:
            print(("" if i == 0 else SEPARATOR + "\n") + args.prompt[i] + tokenizer.decode(row))
    print(clock.report(timings[0], count, len(prompts), acceptance[0] if acceptance else None), file=sys.stderr)
    return 0


class _Clock:
    """on_tokens for diffjax.generate: times the decode steps, and hands the tokens on to a _StreamPrinter if there is
    one."""

    def __init__(self, printer=None):
        self.printer, self.first, self.last, self.steps = printer, None, None, 0

    def __call__(self, step, tokens_B):
        self.last, self.steps = time.perf_counter(), step + 1
        self.first = self.first or self.last
        if self.printer is not None:
            self.printer.add(int(tokens_B[0]))

    def report(self, timing, tokens: int, rows: int, acceptance=None) -> str:
        """One line: the tokens, the compilation's seconds, then the generation's and its tokens/s (comparable between
        plain and speculative decoding); plain: the first token's time (prefill) and the decode rate after it;
        speculative (nothing streamed): the verify steps and the drafts accepted."""
        line = (f"{tokens} tokens: compiled in {timing.compile_seconds:.2f} s, generated in "
                f"{timing.generate_seconds:.2f} s ({tokens / max(timing.generate_seconds, 1e-9):.1f} tokens/s")
        if acceptance is not None:
            return line + (f"; {acceptance.steps} verify steps, {acceptance.accepted} of {acceptance.drafted} drafts "
                           f"accepted ({acceptance.rate:.0%}))")
        line += f"; first token after {self.first - timing.began:.2f} s (prefill)"
        if self.steps > 1 and self.last > self.first:
            line += f", then {rows * (self.steps - 1) / (self.last - self.first):.1f} tokens/s ({rows} x {self.steps - 1} steps)"
        return line + ")"


class _StreamPrinter:
    """Prints one prompt, then its continuation as the tokens come (text held back while it ends in a partial
    character), and the rest when generation ends."""

    def __init__(self, tokenizer, eos, prompt: str):
        self.tokenizer, self.eos, self.tokens, self.printed = tokenizer, eos, [], ""
        print(prompt, end="", flush=True)

    def add(self, token: int):
        if self.eos is not None and self.eos in self.tokens:
            return
        self.tokens.append(token)
        self._print(self.tokenizer.decode(self.tokens).rstrip("\ufffd"))

    def finish(self, row):
        self._print(self.tokenizer.decode(list(row)))
        print()

    def _print(self, text: str):
        if text.startswith(self.printed) and len(text) > len(self.printed):
            print(text[len(self.printed):], end="", flush=True)
            self.printed = text


if __name__ == "__main__":
    command_line.run(main, "diffjax-generate")
