"""Helpers shared by the tests (no fixtures, no tests): conftest.py files and test modules import from here;
no test module imports another."""
