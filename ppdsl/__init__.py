"""ppdsl: a declarative model-parallel language for PyTorch."""

__version__ = "0.1.0"
