"""Tools on top of the library: the command line, the benchmark and the tuner. Nothing in the
library imports this package."""
