"""Shared infrastructure for draftheads: configuration, base-model loading, atomic I/O.

Every entry point (``python -m data_prep``, ``python -m train``, ``python -m evaluation``)
reads its configuration through :mod:`core.config` and its frozen base model through
:mod:`core.base_model`.
"""
