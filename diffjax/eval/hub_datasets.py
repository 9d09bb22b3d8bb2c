"""lm_eval's built-in tasks read their datasets from the Hugging Face Hub. Offline, each download would retry for
~25 s and end in a 40-line ConnectionError; so the CLI asks once whether the Hub answers (before datasets or
huggingface_hub load, which read the offline switches at import), goes offline if not (cached datasets still
load), and turns a dataset out of reach into one line."""

from __future__ import annotations

import logging
import os
import re
import urllib.error
import urllib.request

# (convert.hub imports huggingface_hub only when a function needs it: its offline switches are still unread here)
from diffjax.convert.hub import OFFLINE_REASON, OFFLINE_VARIABLES, is_offline, offline_because

LOCAL_TASK_HINT = ("or evaluate a task on local files: --include-path DIR holding a task YAML with "
                   "`dataset_path: json` and `dataset_kwargs: {data_files: {test: FILE.jsonl}}`")


def offline_unless_reachable(timeout_s: float = 5.0) -> None:
    """Sets HF_HUB_OFFLINE and HF_DATASETS_OFFLINE when the Hub (HF_ENDPOINT) does not answer a HEAD request
    (through the environment's proxies), and diffjax.convert.hub's OFFLINE_REASON to say why (messages then tell
    the user diffjax did it). A user's own setting of either is left as it is."""
    if any(variable in os.environ for variable in OFFLINE_VARIABLES):
        return
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return  # it answered
    except (OSError, ValueError):
        os.environ.update({variable: "1" for variable in OFFLINE_VARIABLES})
        os.environ[OFFLINE_REASON] = f"the Hub ({endpoint}) did not answer within {timeout_s:g} s"


def dataset_out_of_reach(error: ConnectionError) -> str:
    """One line for datasets' "Couldn't reach 'org/name' on the Hub": the task, its dataset and what to do."""
    config = _config_of_the_task_being_built(error)
    named = re.search(r"reach '([^']+)'", str(error))
    dataset = getattr(config, "dataset_path", None) or (named.group(1) if named else "?")
    why = f"not in the local cache (HF_HOME), and {offline_because(OFFLINE_VARIABLES)}" if is_offline() else f"out of reach ({error})"
    return (f"task {getattr(config, 'task', None) or '?'} needs its dataset {dataset} from the Hugging Face Hub, "
            f"{why}: run once online to cache it, {LOCAL_TASK_HINT}")


def _config_of_the_task_being_built(error: BaseException):
    """The config (TaskConfig: .task, .dataset_path) of the lm_eval task whose construction raised `error`."""
    traceback, found = error.__traceback__, None
    while traceback is not None:
        config = getattr(traceback.tb_frame.f_locals.get("self"), "config", None)
        found = config if isinstance(getattr(config, "task", None), str) else found
        traceback = traceback.tb_next
    return found


def quiet_duplicate_logs() -> None:
    """Libraries that print their own log records (huggingface_hub, datasets) stop handing them on to the root
    logger as well, which absl gives a handler of its own: each warning once."""
    import datasets  # noqa: F401 (lm_eval's, loaded here if not yet: it gives huggingface_hub's logger a handler)

    for name, logger in list(logging.root.manager.loggerDict.items()):
        if isinstance(logger, logging.Logger) and logger.handlers and "." not in name:
            logger.propagate = False
