"""Build and set-up scripts (importable for the tests: ``from scripts.build_deb import build``)."""
