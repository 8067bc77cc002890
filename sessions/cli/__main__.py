"""`python -m sessions.cli`: the same entry point as the `rollout-ledger` console script."""

from sessions.cli import main

raise SystemExit(main())
