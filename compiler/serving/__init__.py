"""The call path: the wrapper that stands in for a forward, where its graphs come from, the first-use check."""
