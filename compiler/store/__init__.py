"""Graphs on disk and in memory: the store, manifests, the library, the registry, bundles, trust, safe writes."""
