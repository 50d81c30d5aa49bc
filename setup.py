"""The optional native winnowing extension (proxy/envelope/dataflow/_winnow.c); pyproject.toml
holds the metadata. `optional=True`: without a C compiler the build goes on and fingerprint.py
uses its numpy functions (same fingerprints)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "proxy.envelope.dataflow._winnow",
            sources=["proxy/envelope/dataflow/_winnow.c"],
            optional=True,
        )
    ]
)
