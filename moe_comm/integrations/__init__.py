"""Integrations with the stacks moe_comm is used in (each imports its framework lazily, on use)."""
