"""``python -m flashdmoe`` runs the CLI."""

from flashdmoe.cli import main

raise SystemExit(main())
