import os


def read_lines(path):
    """Read a text file and return its lines without trailing newlines."""
