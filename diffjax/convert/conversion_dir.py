"""The run directory a conversion writes (hf-to-diffjax, upcycle, merge-lora): held while it is written, removed again
when a new one fails, and the HF files beside the weights kept in RUN/hf/."""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

from diffjax.convert import hub
from diffjax.run_dir import RunDir

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".index.json")


@contextlib.contextmanager
def conversion_run_dir(dst, *, overwrite: bool, command: str):
    """The RunDir `command` (hf-to-diffjax, upcycle, merge-lora) writes into `dst`, held (its trainer.lock) from
    before --overwrite removes anything until the conversion ends: a trainer, or another conversion, running there
    refuses it. A new `dst` is removed again if the conversion fails, so no half-written directory is left behind."""
    dst = Path(dst)
    hub.refuse_the_cache(dst)
    created = not dst.exists()
    try:
        run = RunDir.for_conversion(dst, overwrite=overwrite)
        lock = run.lock_for_writing(command)
        try:
            run.remove_conversion_outputs()
            yield run
        finally:
            lock.release()
    except BaseException:
        if created:
            shutil.rmtree(dst, ignore_errors=True)
        raise


def keep_hf_files(src, run: RunDir) -> dict | None:
    """Copy the HF directory `src`'s files but its weights (config.json, tokenizer, generation config) into RUN/hf/;
    returns the data section naming its tokenizer.json (None without one), so that training on and generating
    from the conversion use the checkpoint's own tokenizer."""
    run.hf.mkdir()
    for file in sorted(Path(src).iterdir()):
        if file.is_file() and not file.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(file, run.hf / file.name)
    return {"tokenizer": {"kind": "hf", "path": str(run.hf.absolute())}} if (run.hf / "tokenizer.json").exists() else None
