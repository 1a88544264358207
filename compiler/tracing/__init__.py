"""From a module call to an exported program: flat views, weights, export guards, traces in other processes."""
