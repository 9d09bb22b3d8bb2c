"""The console scripts pyproject.toml installs, but diffjax-train (diffjax.train.cli:run, which loads no jax
itself): each imports its command's module inside diffjax.command_line.run, so that Ctrl-C while jax loads
(seconds) is the same one line as Ctrl-C later."""

from __future__ import annotations

import importlib

from diffjax.command_line import run

# console script -> the module whose main(argv) it runs (also what `python -m` runs, but for diffjax.adoption:
# `python -m diffjax.checkpoint`)
MODULES = {"diffjax-convert": "diffjax.convert.__main__", "diffjax-generate": "diffjax.generate.__main__",
           "diffjax-eval": "diffjax.eval.__main__", "diffjax-checkpoint": "diffjax.adoption"}


def _run(prog: str, argv):
    run(lambda argv: importlib.import_module(MODULES[prog]).main(argv), prog, argv)


def convert(argv=None):
    _run("diffjax-convert", argv)


def generate(argv=None):
    _run("diffjax-generate", argv)


def evaluate(argv=None):
    _run("diffjax-eval", argv)


def checkpoint(argv=None):
    _run("diffjax-checkpoint", argv)
