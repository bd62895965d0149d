"""The analytics pipeline: recordings decoded on Apache Spark (PySpark) into Parquet
tables and a latency/throughput/error report.  ``decode`` holds the pure-Python work
the executors run; ``pipeline`` the Spark plan; ``report`` the text and HTML output."""
