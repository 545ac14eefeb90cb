"""Pooling models (embeddings, scores, classification): docs/pooling.md."""
