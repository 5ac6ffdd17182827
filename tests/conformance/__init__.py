"""A pjdfstest-style conformance suite in Python (written for stepfs):
small cases grouped by syscall, run against a directory.  See runner.py."""
