"""``python -m moe_comm``: the ``moe-comm`` command line (see ``moe_comm.tools.cli``)."""

from .tools.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
