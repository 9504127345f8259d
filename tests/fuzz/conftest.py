"""Fixtures of the fuzzing tests: a memory cap and a scratch folder."""

import contextlib
import resource
import sys

import pytest

from fuzzing import vm_bytes


@pytest.fixture
def cap():
    """`with cap(extra):` limits the address space to what the process mapped when the test began
    plus `extra` (Linux only). The base is fixed per test, not per example: memory a failed
    example leaves mapped (free, but kept by the allocator) must not raise the next one's limit,
    or a MemoryError would not reproduce while shrinking."""
    base = vm_bytes() if sys.platform.startswith("linux") else None

    @contextlib.contextmanager
    def limit(extra: int = 512 << 20):
        if base is None:
            yield
            return
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (base + extra if hard == resource.RLIM_INFINITY
                                                else min(base + extra, hard), hard))
        try:
            yield
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))

    return limit


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """One folder for the files the examples write (each example overwrites its file)."""
    return tmp_path_factory.mktemp("fuzz")
