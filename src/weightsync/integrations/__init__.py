"""Integrations at the edge: inference engines and cluster frameworks."""
