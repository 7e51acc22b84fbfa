"""Tables and files a run produces: pure DataFrame builders (tables.py) and atomic writers (writer.py)."""
