"""The analytics pipeline: recordings decoded on Apache Spark (PySpark) into Parquet
tables and a latency/throughput/error report.

``segments`` reads byte ranges of segment files (with the recording reader's damage
rules); ``decode`` is step 1 (a split to narrow rows), ``connections`` step 2 (edge rows
through the session machine), ``output`` step 3 (topics joined, tables written);
``steps`` runs them in one process, ``pipeline`` as Spark tasks; ``figures`` and
``report`` make the report; ``tables`` names every column; ``reference`` is the
sequential decoder the tests hold the pipeline to."""

from pathlib import Path as _Path

from proxy import compiled as _compiled

#: Modules scripts/setup.sh compiles with mypyc (proxy.compiled); the decoder's hot loops are here.
COMPILED_MODULES = ("decode",)
_compiled.guard(__name__, _Path(__file__).parent, COMPILED_MODULES)
