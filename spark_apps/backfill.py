"""spark-submit shim of the backfill app (``--serve``: the backfill server): ``sequin_provider/spark_apps/backfill.py`` is the app."""

import sys

from sequin_provider.spark_apps.backfill import main

sys.exit(main())
