"""The optional native extensions of the data-flow ledger: winnowing
(proxy/envelope/dataflow/_winnow.c) and the distinctive-token scan (_tokens.c); pyproject.toml
holds the metadata. `optional=True`: without a C compiler the build goes on and fingerprint.py
uses its numpy functions and Python scans (same fingerprints and tokens)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "proxy.envelope.dataflow._winnow",
            sources=["proxy/envelope/dataflow/_winnow.c"],
            optional=True,
        ),
        Extension(
            "proxy.envelope.dataflow._tokens",
            sources=["proxy/envelope/dataflow/_tokens.c"],
            optional=True,
        ),
    ]
)
