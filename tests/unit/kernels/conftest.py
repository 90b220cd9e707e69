"""The custom-op library fixture (``cpu_library``: tests/helpers/kernel_library.py)."""

from kernel_library import cpu_library  # noqa: F401 (a fixture)
