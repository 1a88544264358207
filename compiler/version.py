"""The pack's version, written into every manifest."""

__version__ = "0.1.0"
