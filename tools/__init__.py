"""Developer tools kept outside the package: see tools/README.md."""
