"""An import-only stand-in for torchvision, for the vLLM plugin tests on vLLM's CPU build (see ../README.md).

vLLM's Qwen3.5 module imports its vision model's code, which imports torchvision; the only torchvision wheels that
install beside torch 2.13.0+cpu here are CUDA builds, which fail to load. Text generation never calls torchvision,
so every name here is an inert placeholder class; the test driver puts this folder on the path only when no
working torchvision imports.
"""

__version__ = "0.0.0+oda-test-stub"


class _Placeholder(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(name, (), {})


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Placeholder(name, (), {})
