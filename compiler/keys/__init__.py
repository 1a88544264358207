"""When two calls may share a graph: keys, guards, input structures, shape ranges, example calls."""
