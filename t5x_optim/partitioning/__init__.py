"""Partitioning of optimizer states: state partition rules, axis rules, meshes."""
