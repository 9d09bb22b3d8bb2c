"""`python train.py [--config NAME_OR_PATH] [key=value ...]`: the trainer's command line from a repository checkout,
the same as the `diffjax-train` console script (diffjax/train/cli.py; `--help` and `--help-keys` say more)."""

from diffjax.train.cli import main, run  # noqa: F401 (main: the in-process entry tests call)

if __name__ == "__main__":
    run()
