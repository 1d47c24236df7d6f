"""Abstractive summarisation of PubMed-style articles, streamed with streamds (see README.md)."""
