"""Test scaffolding: fault injection, helpers for tests and soak runs. Never imported by production code.

The one exception is `cobatch serve --enable-fault-injection` (server/cli.py), which wraps the served
runner in `faults.FaultInjectingRunner` for the tests that need a real server (tests/test_layering.py).
"""
