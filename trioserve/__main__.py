"""``python -m trioserve``: the same as the ``trioserve`` command."""

from ._cli import main

raise SystemExit(main())
