"""diffjax-convert {hf-to-diffjax, diffjax-to-hf, upcycle, merge-lora, verify} ...

Exit status: 0 done (verify: within tolerance), 1 verify past tolerance or a write / upload that failed, 2 bad input
(one line on stderr).

    diffjax-convert diffjax-to-hf runs/tiny out/tiny --license apache-2.0 --push-to-hub ORG/NAME   # export, upload
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import sys
import time

from diffjax import command_line
from diffjax.log_lines import os_error_line, print_package_logs

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # conversion is host work; never grab an accelerator


def _peak_rss_mb() -> float:
    """Peak resident memory of this process, MiB. Linux: VmHWM, which (unlike ru_maxrss, inherited
    across fork + exec) starts afresh in a new program."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1024 if sys.platform.startswith("linux") else 2**20)


def _progress(name: str, index: int, count: int) -> None:
    print(f"  [{index + 1}/{count}] {name}", file=sys.stderr, flush=True)


def _parser() -> argparse.ArgumentParser:
    parser = command_line.ArgumentParser(prog="diffjax-convert", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    p = commands.add_parser("hf-to-diffjax", help="HF directory (diffllama / llama / motif) -> diffjax run directory")
    p.add_argument("src", help="HF directory (config.json + safetensors, or pytorch_model*.bin) or Hub name org/name")
    p.add_argument("dst", help="new or empty directory for the diffjax run directory (config.yaml + Orbax checkpoint)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="parameter dtype (default: the checkpoint's)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing conversion in DST")
    _hub_arguments(p, remote_code="also fetch a Hub repository's Python files (its modeling code, e.g. Motif's), "
                                  "kept in DST/hf/ for exports; diffjax never runs them")

    p = commands.add_parser("diffjax-to-hf", help="diffjax run directory or checkpoint -> HF directory")
    p.add_argument("src", help="diffjax run directory, its checkpoints/ directory, or a step directory")
    p.add_argument("dst", help="new or empty directory for the HF model")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="saved tensor dtype (default: the params')")
    p.add_argument("--shard-size", default="5GB", help="largest safetensors shard (e.g. 5GB, 500MB; default 5GB)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing export in DST")
    p.add_argument("--license", metavar="ID", help="the model card's license, a Hub identifier such as apache-2.0 "
                                                   "(default: the source's model card's, else unknown)")
    p.add_argument("--push-to-hub", metavar="ORG/NAME", help="then upload DST to this Hub model repository (created "
                                                             "if absent; HF_TOKEN or `hf auth login`)")
    p.add_argument("--private", action="store_true", help="with --push-to-hub: create the repository private")

    p = commands.add_parser("upcycle", help="a Transformer (HF Llama directory or diffjax run) -> a DIFF run directory "
                                            "computing the same function")
    p.add_argument("src", help="HF Llama directory or Hub name org/name, or a diffjax run directory / checkpoint of "
                               "attention standard")
    p.add_argument("dst", help="new or empty directory for the DIFF model's run directory")
    p.add_argument("--kind", choices=("diff", "diff_v2"), default="diff", help="DIFF V1 (default) or V2")
    p.add_argument("--second-map", choices=("mirror", "zero_query"), default="mirror",
                   help="the second map's queries: a copy of the first's (default) or zeros (V1 with --lambda-init 0)")
    p.add_argument("--lambda-init", type=float, help="V1: one lambda_init for every layer (default: the depth schedule)")
    p.add_argument("--seed", type=int, default=0, help="V1: the draws of the new value half and the lambda vectors")
    p.add_argument("--lambda-warmup", type=int, default=0, metavar="STEPS",
                   help="upcycle for training with lambda grown from 0 over STEPS steps (written to DST's config.yaml "
                        "as optim.lambda_warmup_steps): any --second-map and --lambda-init start as the source")
    p.add_argument("--overwrite", action="store_true", help="replace an existing conversion in DST")
    _hub_arguments(p)

    p = commands.add_parser("merge-lora", help="a LoRA run directory -> a run directory of its base with the adapters "
                                               "merged into the weights")
    p.add_argument("src", help="the LoRA run directory (or one of its checkpoints); its base is its train.init_from")
    p.add_argument("dst", help="new or empty directory for the merged model's run directory")
    p.add_argument("--overwrite", action="store_true", help="replace an existing conversion in DST")

    p = commands.add_parser("verify", help="compare transformers and diffjax on the same prompts")
    p.add_argument("src", help="HF directory or Hub name org/name")
    p.add_argument("--diffjax", metavar="DIR", help="a converted diffjax run directory to check (default: convert SRC in memory)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="both models' dtype, and its tolerances (default float32)")
    p.add_argument("--prompts", type=int, default=4, help="number of random prompts (default 4)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per prompt (default 64)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default 0)")
    _hub_arguments(p, remote_code="run the modeling code SRC ships (needed for Motif; executes SRC's Python files)")
    return parser


def _fine_tune_hint(config_file, dst) -> str:
    """Training starts from a conversion into a run directory of its own: trained on in place, checkpoint rotation
    would remove the converted step (docs/porting.md)."""
    dst = str(dst).rstrip("/")
    return (f"fine-tune it into a new run directory with `diffjax-train --config {config_file} "
            f"train.init_from={dst} train.run_dir={dst}-tuned`")


def _hub_arguments(parser: argparse.ArgumentParser, remote_code: str | None = None) -> None:
    """--revision (and --trust-remote-code) of a command whose SRC may be a Hub name (diffjax.convert.hub)."""
    parser.add_argument("--revision", help="with a Hub name: its branch, tag or commit (default: its main)")
    if remote_code:
        parser.add_argument("--trust-remote-code", action="store_true", help=remote_code)


def _export(args) -> None:
    """diffjax-to-hf, then with --push-to-hub the upload (its repository id and offline mode checked first)."""
    from diffjax.convert import hub
    from diffjax.convert.hf_directories import diffjax_to_hf

    if args.private and not args.push_to_hub:
        raise ValueError("--private goes with --push-to-hub")
    if args.push_to_hub:
        hub.check_pushable(args.push_to_hub)
    out = diffjax_to_hf(args.src, args.dst, dtype=args.dtype, max_shard_size=args.shard_size, overwrite=args.overwrite,
                        progress=_progress, license=args.license, card_name=args.push_to_hub)
    print(f"wrote {out} (load with transformers.AutoModelForCausalLM.from_pretrained; its model card: README.md)")
    if args.push_to_hub:
        url = hub.push(out, args.push_to_hub, private=args.private)
        print(f"pushed {out} to https://huggingface.co/{args.push_to_hub} ({url})")


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    print_package_logs()
    # Orbax's notes on formats it is not using, and its errors logged with their tracebacks (a full disk: ~100
    # lines), which it raises too: the conversion's one line says them.
    logging.getLogger("absl").setLevel(logging.CRITICAL)
    # Import jax, orbax and the checkpoint code, and start jax's backends, before taking the memory baseline: what
    # the installed PJRT plugins map (~90 MiB with the CUDA plugin) is start-up, not the conversion's.
    import jax
    import orbax.checkpoint  # noqa: F401

    jax.devices()

    from diffjax.params_checkpoint import CheckpointWriteError
    from diffjax.convert import hf_directories, verify  # noqa: F401
    from diffjax.convert.common import ConversionError, refuse_overlap
    from diffjax.convert.hub import PushError, refuse_the_cache
    from diffjax.run_dir import RunDir, RunDirInUseError

    start, base_rss = time.time(), _peak_rss_mb()
    try:
        if getattr(args, "dst", None) is not None:  # every subcommand that writes
            refuse_overlap(args.src, args.dst)
            refuse_the_cache(args.dst)
        if args.command == "hf-to-diffjax":
            from diffjax.convert.hf_directories import hf_to_diffjax
            step_dir = hf_to_diffjax(args.src, args.dst, dtype=args.dtype, overwrite=args.overwrite, progress=_progress,
                                     revision=args.revision, trust_remote_code=args.trust_remote_code)
            print(f"wrote {step_dir} (run directory {args.dst}; "
                  f"{_fine_tune_hint(RunDir.of_step(step_dir).config_file, args.dst)})")
        elif args.command == "diffjax-to-hf":
            _export(args)
        elif args.command == "upcycle":
            from diffjax.convert.upcycle import upcycle_directory
            step_dir = upcycle_directory(args.src, args.dst, kind=args.kind, second_map=args.second_map,
                                         lambda_init=args.lambda_init, seed=args.seed,
                                         lambda_warmup_steps=args.lambda_warmup, overwrite=args.overwrite,
                                         revision=args.revision)
            print(f"wrote {step_dir} ({_fine_tune_hint(RunDir.of_step(step_dir).config_file, args.dst)})")
        elif args.command == "merge-lora":
            from diffjax.convert.lora_merge import merge_lora_directory
            step_dir = merge_lora_directory(args.src, args.dst, overwrite=args.overwrite)
            print(f"wrote {step_dir} (export with `diffjax-convert diffjax-to-hf {args.dst} HF_DIR`)")
        else:
            from diffjax.convert.verify import verify
            result = verify(args.src, diffjax_path=args.diffjax, dtype=args.dtype, prompts=args.prompts,
                            seq_len=args.seq_len, seed=args.seed, trust_remote_code=args.trust_remote_code,
                            revision=args.revision)
            print(result.report())
            return 0 if result.passed else 1
    except (CheckpointWriteError, PushError) as error:  # the input was fine; the disk or the upload was not
        print(f"error: {error}", file=sys.stderr)
        return 1
    except (ConversionError, ValueError, FileNotFoundError, FileExistsError, RunDirInUseError, PermissionError) as error:
        # ValueError also covers ModelConfig's validation of a run directory's config.yaml
        print(f"error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # a write that failed past the checks (a disk that filled up, ...)
        print(f"error: {os_error_line(error)}", file=sys.stderr)
        return 1
    peak = _peak_rss_mb()
    print(f"{time.time() - start:.1f} s, peak memory {peak:.0f} MiB ({peak - base_rss:.0f} MiB above the "
          f"{base_rss:.0f} MiB after start-up)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    command_line.run(main, "diffjax-convert")
