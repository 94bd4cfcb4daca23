"""kbit's version (pyproject.toml's, checked equal by tests/test_packaging.py): a leaf, so that modules below the
package's __init__ can name it without importing the package."""

__version__ = "0.1.0"
