"""spark-submit shim of the replication stream app: ``sequin_provider/spark_apps/replication_stream.py`` is the app."""

import sys

from sequin_provider.spark_apps.replication_stream import main

sys.exit(main())
