"""The MoE layer and its parts (floor 4): ``layer``, ``experts``, ``router``, ``balancing``,
``overlap``, ``receive_layout`` (the experts' rows in either receive layout, for the layer, the
integrations and the bench) and ``reference`` (the layer computed densely in one process, the tests' yardstick).

It builds on the public API at the package root (``Dispatcher``) and below.
"""
