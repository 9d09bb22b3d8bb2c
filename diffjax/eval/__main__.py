"""diffjax-eval --model-path PATH --tasks TASK[,TASK...] [--include-path DIR] [--limit N] [--output JSON]

Runs lm-evaluation-harness tasks (lm_eval.simple_evaluate) on a diffjax checkpoint: a run directory (diffjax-train's
or a conversion's), its checkpoints/ directory, a step directory or a Hugging Face directory. Prints lm_eval's
results table; --output writes the results as JSON (with every sample's responses under --log-samples).
Tasks: lm_eval's own (indexing its ~15,000 task configs takes ~15 s) or your YAML configs under --include-path
(looked up there first: when every task is found there, lm_eval's are not indexed at all).
Offline (HF_HUB_OFFLINE set by you, or by diffjax-eval when the Hub does not answer within 5 s), tasks read
their datasets from the local cache only, and a dataset not cached is one line naming the task and who went offline.
Exit status: 0 done, 2 bad input or a dataset out of reach (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from diffjax import command_line
from diffjax.log_lines import print_package_logs


def _parser() -> argparse.ArgumentParser:
    parser = command_line.ArgumentParser(prog="diffjax-eval",
                                         description="Run lm-evaluation-harness tasks on a diffjax checkpoint.")
    parser.add_argument("--model-path", required=True, metavar="PATH",
                        help="a run directory, its checkpoints/ directory, a step directory, a Hugging Face directory "
                             "or Hub name org/name")
    parser.add_argument("--revision", help="with a Hub name: its branch, tag or commit (default: its main)")
    parser.add_argument("--tasks", required=True, metavar="T1,T2", help="comma-separated lm_eval task (or group) names")
    parser.add_argument("--include-path", metavar="DIR", help="a directory of your own task YAML configs")
    parser.add_argument("--no-builtin-tasks", action="store_true",
                        help="look tasks up under --include-path only (never index lm_eval's own)")
    parser.add_argument("--num-fewshot", type=int, metavar="N", help="few-shot examples per prompt (default: the task's)")
    parser.add_argument("--limit", type=float, metavar="N", help="documents per task: a count, or a fraction if < 1")
    parser.add_argument("--batch-size", type=int, default=8, metavar="N", help="rows per forward pass (default 8)")
    parser.add_argument("--max-length", type=int, metavar="N", help="context length (default: the model's max_seq_len)")
    parser.add_argument("--max-gen-toks", type=int, default=256, metavar="N",
                        help="generation budget when a task sets none (default 256)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), help="compute and parameter dtype (default: the checkpoint's)")
    parser.add_argument("--mesh", metavar="AXES", help="a device mesh, e.g. data=4,tensor=2 (the trainer's axes data, "
                        "fsdp, context, tensor; context splits scored sequences, not generation)")
    parser.add_argument("--tokenizer", metavar="PATH", help="a tokenizer.json (or its directory), or 'byte' (default: the checkpoint's)")
    parser.add_argument("--seed", type=int, default=1234, help="sampled generation's seed (default 1234)")
    parser.add_argument("--output", metavar="JSON", help="write the results here")
    parser.add_argument("--log-samples", action="store_true", help="keep every sample's inputs and responses in --output")
    return parser


def _task_manager(names: list[str], include_path: str | None, builtin: bool):
    """A TaskManager that knows every name (include_path's alone when that suffices); ValueError naming the unknown."""
    from lm_eval.tasks import TaskManager

    if not builtin and include_path is None:
        raise ValueError("--no-builtin-tasks needs --include-path (the directory of your task configs)")
    manager = None
    if include_path is not None:
        if not Path(include_path).is_dir():
            raise FileNotFoundError(f"--include-path: {include_path} is not a directory")
        manager = TaskManager(include_path=include_path, include_defaults=False)
    if (manager is None or _unknown(manager, names)) and builtin:
        manager = TaskManager(include_path=include_path)
    if unknown := _unknown(manager, names):
        where = ("lm_eval's tasks" if builtin else "") + (" or " if builtin and include_path else "") + \
                (f"--include-path {include_path}" if include_path else "")
        raise ValueError(f"--tasks: unknown task(s) {', '.join(unknown)} (not in {where}; "
                         f"`python -m lm_eval ls tasks` lists lm_eval's)")
    return manager


def _unknown(manager, names: list[str]) -> list[str]:
    known = set(manager.all_tasks)
    return [name for name in names if name not in known and not manager.match_tasks([name])]


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    from diffjax.eval import hub_datasets

    hub_datasets.offline_unless_reachable()  # before lm_eval loads datasets and huggingface_hub
    try:
        print_package_logs()
        from diffjax.eval import require_lm_eval

        lm_eval = require_lm_eval()
        names = [name.strip() for name in args.tasks.split(",") if name.strip()]
        if not names:
            raise ValueError("--tasks names no task")
        from diffjax.convert.hub import is_hub_name

        if not Path(args.model_path).exists() and not is_hub_name(args.model_path):
            raise FileNotFoundError(f"--model-path: {args.model_path} does not exist")
        if args.limit is not None and args.limit <= 0:
            raise ValueError(f"--limit must be positive, got {args.limit:g}")
        manager = _task_manager(names, args.include_path, not args.no_builtin_tasks)

        from diffjax.eval.lm_eval_adapter import DiffjaxLM, load_for_eval, parse_mesh

        mesh = parse_mesh(args.mesh)
        loaded, tokenizer = load_for_eval(args.model_path, dtype=args.dtype, mesh=mesh, tokenizer=args.tokenizer,
                                          what="--model-path", revision=args.revision)
        model = DiffjaxLM(args.model_path, model=loaded, tokenizer=tokenizer, batch_size=args.batch_size,
                          max_length=args.max_length, max_gen_toks=args.max_gen_toks, mesh=mesh, seed=args.seed)
        limit = None if args.limit is None else (int(args.limit) if args.limit >= 1 else args.limit)
        hub_datasets.quiet_duplicate_logs()
        results = lm_eval.simple_evaluate(model=model, tasks=names, task_manager=manager, num_fewshot=args.num_fewshot,
                                          limit=limit, log_samples=args.log_samples or False)
    except (ValueError, TypeError, FileNotFoundError, ImportError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except ConnectionError as error:  # datasets' "Couldn't reach 'org/name' on the Hub"
        print(f"error: {hub_datasets.dataset_out_of_reach(error)}", file=sys.stderr)
        return 2
    from lm_eval.utils import handle_non_serializable, make_table

    print(make_table(results))
    if results.get("groups"):
        print(make_table(results, "groups"))
    if args.output:
        if not args.log_samples:
            results.pop("samples", None)
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    command_line.run(main, "diffjax-eval")
