"""Test-session setup that must happen before any test module imports triton."""

import os

import pytest
import torch

# Without a GPU, the Triton kernels are tested through Triton's CPU interpreter. Triton fixes
# interpreted-vs-compiled when it is first imported, so this has to be set before anything imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pyproject's addopts run the tests on two pytest-xdist workers, a file per worker. Two workers with two intra-op
# threads each would oversubscribe CI's 2 cores (OpenMP threads spin while they wait), so each worker computes on one.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


# Each starts about ten vLLM engines: together they take longer than all other files.
VLLM_FILES = ("test_vllm_plugin.py", "test_vllm_hybrids.py")


def pytest_collection_modifyitems(config, items):
    """The vLLM files first: with ``--dist loadfile --no-loadscope-reorder`` files go to the workers in collection
    order, one each to begin with, so each worker starts on one of them and the other files fill in after."""
    items.sort(key=lambda item: VLLM_FILES.index(item.path.name) if item.path.name in VLLM_FILES else len(VLLM_FILES))


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: intra-op threads only add synchronization (10x slower on a busy 2-core machine). A module
    opts in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
