"""``pulsar-tap analyze`` as a Spark application: the file spark-submit runs.

    spark-submit --master spark://spark-master:7077 \
        --conf spark.pyspark.python=/opt/pulsar-tap/venv/bin/python \
        deploy/spark/analyze_job.py /shared/recordings --out /shared/analysis

Takes the arguments of ``pulsar-tap analyze`` (``--master`` is spark-submit's); the
tables, the reports, the exit status and the handling of interrupts are the same.
Every executor needs pulsar-tap installed in the Python ``spark.pyspark.python``
names (see README.md beside this file).
"""

import sys

from proxy.cli import main

if __name__ == "__main__":
    sys.exit(main(["analyze", *sys.argv[1:]]))
