"""Repository scripts; the Python ones that lay out documents run as `python -m scripts.NAME`."""
