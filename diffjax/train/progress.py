"""Progress display: a tqdm bar on a terminal, or one log line per logged step elsewhere."""

from __future__ import annotations

import functools
import math
import os
import sys
from collections.abc import Callable


def format_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def terminal_size() -> os.terminal_size:
    """stderr's terminal (columns, lines); 0 where it reports none (`script`, some `docker exec -t` give 0x0)."""
    try:
        return os.get_terminal_size(sys.stderr.fileno())
    except (OSError, ValueError):
        return os.terminal_size((0, 0))


class Progress:
    """`log`: the run's log, which writes each message on a line of its own while the bar is drawn (the trainer
    gives it to hooks as run.log). `shown(values)`: {label: text} shown beside the loss (the kinds' facets',
    diffjax.model.facets.Facet.shown: e.g. the MTP depths' losses)."""

    def __init__(self, style: str, start_step: int, total_steps: int, tokens_per_step: int, log,
                 shown: Callable[[dict], dict[str, str]] = lambda values: {}):
        self.total, self.tokens_per_step, self.log, self.shown = total_steps, tokens_per_step, log, shown
        use_bar = style == "bar" or (style == "auto" and sys.stderr.isatty())
        self.bar = None
        if use_bar and start_step < total_steps:
            from tqdm import tqdm

            # tqdm reads the size itself, minus one: on a 0x0 terminal a width of -1 and a height of -1,
            # which hides the bar ("more hidden" below row -1). There, a fixed 100 x 20.
            sized = min(terminal_size()) > 0
            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=sized,
                            ncols=None if sized else 100, nrows=None if sized else 20)
            self.log = functools.partial(_beside_the_bars, log)

    def update(self, step: int, values: dict[str, float]):
        rate = values.get("tokens_per_second")
        shown = self.shown(values)
        if self.bar is not None:
            postfix = {"loss": f"{values['loss']:.4f}", **shown}
            if rate:
                postfix["tok/s"] = f"{rate:,.0f}"
            self.bar.set_postfix(postfix, refresh=False)  # before the update that draws it
            self.bar.update(step - self.bar.n)
            self.bar.refresh()  # tqdm skips redraws within its mininterval; this is once per log interval
            return
        line = (f"step {step:>{len(str(self.total))}}/{self.total} | loss {values['loss']:.4f}"
                + "".join(f" | {label} {text}" for label, text in shown.items())
                + f" | grad norm {values['grad_norm']:.3f} | lr {values['lr']:.2e}")
        if rate:
            eta = (self.total - step) * self.tokens_per_step / rate
            line += f" | {rate:,.0f} tok/s | eta {format_duration(eta)}"
            if "mfu" in values:
                line += f" | MFU {values['mfu']:.1%}"
        self.log(line)

    def note(self, message: str):
        self.log(message)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _beside_the_bars(log, message: str) -> None:
    """log(message) with tqdm's bars cleared first and drawn again after: the message gets a line of its own
    (stdout and the bar's stderr share a terminal line otherwise)."""
    from tqdm import tqdm

    with tqdm.external_write_mode():
        log(message)
