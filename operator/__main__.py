"""`python -m anneal.operator` = `anneal operator` (the operator image's entry point)."""

from anneal.operator.main import main

raise SystemExit(main())
