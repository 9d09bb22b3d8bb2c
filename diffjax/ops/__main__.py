"""`python -m diffjax.ops --config X --device v5e ...`: how each attention call of a model runs, and why. The preview
lives in diffjax.train.route_preview: it reads run configs and builds attention modules, layers above ops."""

from __future__ import annotations

from diffjax import command_line


def main(argv=None) -> int:
    """The route preview's main (imported when run: a `__main__` may import up lazily)."""
    from diffjax.train.route_preview import main as preview

    return preview(argv)


if __name__ == "__main__":
    command_line.run(main, "python -m diffjax.ops")
