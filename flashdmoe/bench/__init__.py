"""``flashdmoe bench``: the fused MoE kernel timed beside unfused PyTorch baselines (docs/design.md §12).

``configure_parser(parser)`` adds the options to an argparse (sub)parser, ``run(args) -> int`` runs
them, ``main(argv=None)`` does both. The suites are listed in ``flashdmoe.bench.registry``.
"""

from flashdmoe.bench.cli import configure_parser, main, run

__all__ = ["configure_parser", "main", "run"]
