"""The tools (floor 6): the ``moe-comm`` command line (``cli``), ``job`` (``moe-comm run``),
``spawn`` (the CPU/GPU rank launcher), ``bench`` and its ``baselines``.

Nothing in the library imports them.
"""
