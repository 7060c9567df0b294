"""``python -m flashdmoe.bench`` runs the benchmark CLI."""

from flashdmoe.bench.cli import main

raise SystemExit(main())
