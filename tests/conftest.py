"""Test-session setup that must happen before any test module imports triton."""

import os

import pytest
import torch

# Without a GPU, the Triton kernels are tested through Triton's CPU interpreter. Triton fixes
# interpreted-vs-compiled when it is first imported, so this has to be set before anything imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: intra-op threads only add synchronization (10x slower on a busy 2-core machine). A module
    opts in with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
