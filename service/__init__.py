"""toko-api: the product API process."""

__version__ = "0.1.0"
