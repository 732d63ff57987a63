"""The version of mlfabric: the one place it is written (setup.py reads this file as text, and
mlfabric.__version__ imports it)."""
__version__ = "0.1.0"
