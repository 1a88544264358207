"""The standalone demo (`python -m compiler demo`) and the small random-weight models it and the tests build."""
