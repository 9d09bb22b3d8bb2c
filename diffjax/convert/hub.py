"""Everything diffjax does with the Hugging Face Hub; huggingface_hub (a dependency of transformers) is imported here
only.

A checkpoint or tokenizer argument as a local directory: the directory itself, or a Hub name read through
huggingface_hub's cache. An existing path always wins. Otherwise a name `org/name` (at `revision`: a branch, tag or
commit; default the repository's main) is resolved by `huggingface_hub.snapshot_download`, which honours
HF_HUB_OFFLINE, HF_HOME / HF_HUB_CACHE and HF_TOKEN, and fetches only the files diffjax reads: for a checkpoint
config.json, the safetensors weights and their index (PyTorch `pytorch_model*.bin` only where a repository has no
safetensors), the tokenizer and generation files, and the repository's Python files only with trust_remote_code; for
a tokenizer its files alone. A dataset's snapshot is only looked up in the cache (`cached_snapshot`: datasets streams
or prepares it itself when online). Every failure is one FileNotFoundError line saying what is missing and how to
fetch it. `push` uploads an export (huggingface_hub's upload_folder).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from diffjax.log_lines import first_line

CONFIG_AND_TOKENIZER = ("config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json",
                        "added_tokens.json", "vocab.json", "merges.txt", "chat_template*",
                        "README.md")  # the model card: its license and terms go on with an export
SAFETENSORS = ("*.safetensors", "model.safetensors.index.json")
PYTORCH_BIN = ("pytorch_model*.bin", "pytorch_model.bin.index.json")  # read only where there are no safetensors
TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")  # what HFTokenizer reads
REMOTE_CODE = ("*.py",)
_TOP_LEVEL_ONLY = ("*/*",)  # the files diffjax reads sit at a repository's top level
# Set beside HF_HUB_OFFLINE where diffjax itself switched offline mode on (diffjax-eval, when the Hub does not
# answer): why, so that messages tell that apart from the user's own setting.
OFFLINE_REASON = "DIFFJAX_OFFLINE_REASON"
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
# org/name as the Hub spells repository ids (no "..", no "--", no leading or trailing "." / "-" in a part).
_HUB_NAME = re.compile(r"^(?!.*(?:\.\.|--))[A-Za-z0-9_](?:[\w.-]*[\w])?/[A-Za-z0-9_](?:[\w.-]*[\w])?$")


def is_hub_name(text: str) -> bool:
    """Whether `text` reads as a Hub repository id `org/name` (a path such as ./x, /x or a/b/c does not)."""
    return bool(_HUB_NAME.match(text))


def resolve(src: str | os.PathLike, *, revision: str | None = None, trust_remote_code: bool = False):
    """`src` itself where it exists or is no Hub name (its reader reports a missing path), else the local snapshot
    directory of the Hub model `src` (`org/name`) at `revision`, fetched (the needed files only) unless
    HF_HUB_OFFLINE is set. trust_remote_code: the repository's Python files too."""
    name = os.fspath(src) if isinstance(src, (str, os.PathLike)) else str(src)
    hub_name = is_hub_name(name) and not Path(name).exists()
    if revision is not None and not hub_name:
        raise ValueError(f"revision {revision!r} applies to a Hugging Face Hub name (org/name), and {name!r} is "
                         f"{'a local path' if Path(name).exists() else 'not one'}")
    if not hub_name:
        return src
    huggingface_hub = _huggingface_hub(name)
    patterns = CONFIG_AND_TOKENIZER + SAFETENSORS + (REMOTE_CODE if trust_remote_code else ())
    snapshot = _snapshot(huggingface_hub, name, revision, patterns)
    if not any(snapshot.glob("*.safetensors")):
        snapshot = _snapshot(huggingface_hub, name, revision, PYTORCH_BIN)
    has_weights = any(snapshot.glob("*.safetensors")) or any(snapshot.glob("pytorch_model*.bin"))
    if not (snapshot / "config.json").is_file() or not has_weights:  # (offline: a snapshot cached only in part)
        raise FileNotFoundError(f"{described(name, revision)}: the snapshot in {snapshot} has no config.json or no "
                                f"weights (*.safetensors, pytorch_model*.bin); {fetch_hint(name, revision)}")
    return snapshot


def resolve_tokenizer(src: str | os.PathLike, *, revision: str | None = None):
    """`src` itself where it exists or is no Hub name, else the local snapshot directory of the Hub model `src` at
    `revision` holding its tokenizer files (fetched unless HF_HUB_OFFLINE is set; its weights never)."""
    name = os.fspath(src)
    if not is_hub_name(name) or Path(name).exists():
        if revision is not None:
            raise ValueError(f"data.tokenizer.revision {revision!r} applies to a Hugging Face Hub name (org/name), and "
                             f"{name!r} is {'a local path' if Path(name).exists() else 'not one'}")
        return src
    snapshot = _snapshot(_huggingface_hub(name), name, revision, TOKENIZER)
    if not (snapshot / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{described(name, revision)} has no tokenizer.json (its snapshot {snapshot}): "
                                "diffjax reads a Hugging Face tokenizer from tokenizer.json; for a SentencePiece-only "
                                "repository, fetch its .model file and set data.tokenizer.kind sentencepiece")
    return snapshot


def cached_snapshot(name: str, *, revision: str | None = None, repo_type: str = "dataset") -> Path | None:
    """The snapshot of the Hub repository `name` at `revision` in huggingface_hub's cache, fetching nothing (None:
    not cached, or huggingface_hub absent)."""
    try:
        import huggingface_hub
        from huggingface_hub import errors
    except ImportError:
        return None
    try:
        return Path(huggingface_hub.snapshot_download(name, repo_type=repo_type, revision=revision,
                                                      local_files_only=True))
    except (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled, FileNotFoundError):
        return None


def is_offline() -> bool:
    """Whether the environment switches huggingface_hub or datasets to offline mode (OFFLINE_VARIABLES)."""
    return any(os.environ.get(v, "").strip().lower() in ("1", "on", "yes", "true") for v in OFFLINE_VARIABLES)


class PushError(RuntimeError):
    """An upload that failed after its export was written (the network, the token, the Hub's answer): one line."""


def check_pushable(repo_id: str):
    """huggingface_hub, where `repo_id` is a Hub id and offline mode is off (checked before an export is written);
    else ValueError / FileNotFoundError, one line."""
    if not is_hub_name(repo_id):
        raise ValueError(f"--push-to-hub {repo_id!r} is not a Hub repository id (org/name)")
    if is_offline():
        raise ValueError(f"--push-to-hub {repo_id}: {offline_because(OFFLINE_VARIABLES)}; "
                         "unset it to upload")
    return _huggingface_hub(repo_id)


def push(folder: str | os.PathLike, repo_id: str, *, private: bool = False,
         commit_message: str = "Upload with diffjax") -> str:
    """Upload every file of `folder` (an export) to the Hub model repository `repo_id`, created if absent (private
    if asked): huggingface_hub's create_repo + upload_folder, HF_TOKEN or `hf auth login`'s token. Returns the
    commit's URL. A bad repository id or offline mode is a ValueError, a missing huggingface_hub a
    FileNotFoundError, a failed upload a PushError: one line each."""
    huggingface_hub = check_pushable(repo_id)
    from huggingface_hub import errors

    api = huggingface_hub.HfApi()
    try:
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        commit = api.upload_folder(folder_path=os.fspath(folder), repo_id=repo_id, repo_type="model",
                                   commit_message=commit_message)
    except errors.LocalTokenNotFoundError:
        problem = "no Hugging Face token: set HF_TOKEN or run `hf auth login`"
    except errors.HfHubHTTPError as error:
        status = getattr(error.response, "status_code", None)
        problem = {401: "the token was refused (set HF_TOKEN or run `hf auth login`)",
                   403: "the token may not write there (it needs write access to the repository or organisation)"
                   }.get(status, f"the Hub answered: {first_line(error)}")
    except (OSError, ValueError) as error:  # the network, a revision the Hub refuses
        problem = f"{type(error).__name__}: {first_line(error)}"
    else:
        return str(getattr(commit, "commit_url", commit))
    raise PushError(f"--push-to-hub {repo_id}: the upload of {folder} failed: {problem} (the export is complete: "
                    f"upload it again with `hf upload {repo_id} {folder}`)")


def refuse_the_cache(destination: str | os.PathLike) -> None:
    """ValueError when `destination` lies in the Hugging Face cache (HF_HUB_CACHE, HF_HOME), links resolved:
    diffjax never writes there (a snapshot is huggingface_hub's, read by every program that loads the model)."""
    try:
        from huggingface_hub import constants
        roots = (constants.HF_HUB_CACHE, constants.HF_HOME)
    except ImportError:  # its defaults, from the environment
        home = os.environ.get("HF_HOME") or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
        roots = (os.environ.get("HF_HUB_CACHE") or os.path.join(home, "hub"), home)
    target = Path(destination).resolve()
    for root in (Path(root).resolve() for root in roots):
        if target == root or root in target.parents:
            raise ValueError(f"{destination} is in the Hugging Face cache {root}: diffjax does not write there (its "
                             "snapshots are read by every program that loads those models); choose a directory "
                             "outside it")


def hub_cache() -> str:
    """huggingface_hub's cache of Hub snapshots (HF_HUB_CACHE, under HF_HOME)."""
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def _huggingface_hub(name: str):
    try:
        import huggingface_hub
    except ImportError:
        raise FileNotFoundError(f"{name} is not a local directory; reading it as a Hugging Face Hub name needs "
                                "huggingface_hub: pip install 'diffjax[hub]'") from None
    return huggingface_hub


def _snapshot(huggingface_hub, name: str, revision: str | None, patterns) -> Path:
    """snapshot_download of `patterns`, its errors as one FileNotFoundError line each."""
    from huggingface_hub import errors

    try:
        return Path(huggingface_hub.snapshot_download(name, revision=revision, allow_patterns=list(patterns),
                                                      ignore_patterns=list(_TOP_LEVEL_ONLY)))
    except errors.RevisionNotFoundError:
        problem = f"the Hub has no revision {revision!r} of {name}"
    except errors.GatedRepoError:
        problem = f"{name} is gated: accept its terms on the Hub, then set HF_TOKEN (or run `hf auth login`)"
    except errors.RepositoryNotFoundError:
        problem = f"{name}: no such model on the Hugging Face Hub (a private one needs HF_TOKEN or `hf auth login`)"
    except errors.LocalEntryNotFoundError as error:
        offline = offline_because() if huggingface_hub.constants.HF_HUB_OFFLINE else (
            f"the Hub could not be reached ({first_line(error.__cause__ or error)})")
        problem = (f"{described(name, revision)} is not a local directory and is not (fully) in the Hugging Face "
                   f"cache {huggingface_hub.constants.HF_HUB_CACHE}, and {offline}")
    except (OSError, ValueError) as error:  # other HTTP errors, a name the Hub refuses
        problem = f"{described(name, revision)}: {type(error).__name__}: {first_line(error)}"
    raise FileNotFoundError(f"{problem}; {fetch_hint(name, revision)}")


def offline_because(variables=("HF_HUB_OFFLINE",)) -> str:
    """Who switched offline mode on, and why: diffjax (OFFLINE_REASON says why) or the user (those of `variables`
    set in the environment)."""
    if reason := os.environ.get(OFFLINE_REASON):
        return f"diffjax switched to offline mode (set HF_HUB_OFFLINE) because {reason}"
    return f"offline mode is on ({' and '.join(v for v in variables if v in os.environ) or variables[0]} set in your environment)"


def described(name: str, revision: str | None) -> str:
    """`name`, at `revision` when one is given."""
    return name if revision is None else f"{name} at revision {revision!r}"


def fetch_hint(name: str, revision: str | None, *, repo_type: str = "model") -> str:
    """How to put the Hub repository `name` into the cache, as a clause."""
    command = (f"hf download {name}" + (f" --repo-type {repo_type}" if repo_type != "model" else "")
               + (f" --revision {revision}" if revision is not None else ""))
    return f"fetch it with `{command}` where the Hub is reachable (HF_HUB_OFFLINE unset), or pass a local directory"
