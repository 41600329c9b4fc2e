"""One contract suite per Protocol, run on every implementation."""
