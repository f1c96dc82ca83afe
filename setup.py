"""Builds the one C file trioserve has: llama.cpp's abort callback (trioserve/_backends/_abort.c).
Everything else is configured in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("trioserve._backends._abort", ["trioserve/_backends/_abort.c"])])
