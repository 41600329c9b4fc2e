"""Helpers shared by the test suites and the demo: real S3 servers on 127.0.0.1 (no pytest here)."""
