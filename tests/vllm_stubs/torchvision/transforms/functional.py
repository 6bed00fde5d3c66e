from torchvision import __getattr__  # noqa: F401  (placeholders: see torchvision/__init__.py)
