"""The MoE layer and its parts (floor 4): ``layer``, ``experts``, ``router``, ``balancing``,
``overlap`` and ``reference`` (the layer computed densely in one process, the tests' yardstick).

It builds on the public API at the package root (``Dispatcher``) and below.
"""
