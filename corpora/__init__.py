"""Test corpora for the tests, benchmarks and examples of this checkout; not installed.

`corpora.synthetic` writes PubMed/arXiv-layout corpora and small-line or small-file corpora,
deterministically from a seed. The library (`streamds`) and the converter (`preprocess`)
never import this package: it is a development helper, left out of the wheel.
"""
